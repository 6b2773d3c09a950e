#!/bin/bash
# On a CPU box, before the device calls of the learning bench: play what its SFT needs and needs no GPU -- the
# games, the tokenizer and the expert episodes under every run's rendering (`bench.learning --stage expert`; 5 min
# on 2 cores here) -- and pack the episodes as .devlearn/ENV_sft_inputs.tar.xz (TextWorld: 0.9 MB; the games, 2.8 MB
# more, do not fit one carry beside the SGLang bundle: the device generates them again, the same from the same
# seeds, in about a minute). Carry .devlearn with the call:
# learning_check.sh unpacks it into /tmp, and the device's SFT uses the episodes. The tokenizer they are tokenized
# with travels beside them (the base model's tokenizer files, ~40 KB): the device builds its base model around it
# rather than learning one again (harness.run.prepare_model). ALFWorld's, learnt again on the H100 on 2026-12-07,
# came out different (its games were then worded differently on every machine: envs/alfworld/data.py) and the
# episodes were played again there (333 s). harness.sft.sft_key hashes the tokenizer and the task set's
# games_version; a mismatch says what differs and plays them again. Paths are the device's (/tmp/learning/ENV, /tmp/kvstreams_cache): the key holds the base
# model's path.
#   bash bench/device/sft_inputs.sh textworld [--section.key value ...]
# INPUTS: the archive to write (default .devlearn/ENV_sft_inputs.tar.xz), e.g. beside it for another config.
set -eo pipefail
ENV=$1; shift || true
case $ENV in textworld|alfworld) ;; *) echo "usage: bash bench/device/sft_inputs.sh textworld|alfworld"; exit 2 ;; esac
PY=${PYTHON:-.venv/bin/python}
KVSTREAMS_CACHE=/tmp/kvstreams_cache $PY -m bench.learning --config "configs/$ENV/gpu_small.toml" \
  --out-dir "/tmp/learning/$ENV" --json "/tmp/learning/$ENV/expert_report.json" --stage expert \
  --inference.device cpu "$@"
INPUTS=${INPUTS:-.devlearn/${ENV}_sft_inputs.tar.xz}
mkdir -p "$(dirname "$INPUTS")"
XZ_OPT=-9e tar -cJf "$INPUTS" -C /tmp "learning/$ENV/sft/expert_episodes.pt" \
  "learning/$ENV/model/tokenizer.json" "learning/$ENV/model/tokenizer_config.json" \
  "learning/$ENV/model/chat_template.jinja"
ls -la "$INPUTS"
