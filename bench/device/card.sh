# Source from the repository root on the GPU device: DEVICE_CARD names the card a call got (h100, h200; gpu when
# nvidia-smi cannot tell), for the names of the results it writes. A call may get either card, and a result named
# after the other one had to be renamed by hand (2026-12-07: an H100's concentration study came back as *_h200.json).
DEVICE_CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr 'H' 'h')
export DEVICE_CARD=${DEVICE_CARD:-gpu}
