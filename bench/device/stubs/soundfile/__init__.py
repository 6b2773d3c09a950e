"""Stand-in for ``soundfile`` on the GPU device (no registry there; the SGLang bundle leaves it out): SGLang's HTTP
server imports it at module level for its audio endpoints, which a text benchmark never calls. Any use raises."""


def _unavailable(*args, **kwargs):
    raise RuntimeError("soundfile is a stub on the GPU device (bench/device/stubs): audio is not supported there")


read = write = info = SoundFile = _unavailable
__version__ = "0.0-stub"
