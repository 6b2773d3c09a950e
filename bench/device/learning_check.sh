#!/bin/bash
# One-command H200 run of the learning bench (issue 24), from the repository root:
#   bash bench/device/learning_check.sh textworld [STAGE ...]   # STAGE: all (default), sft, kv_streams, reprefill,
#   bash bench/device/learning_check.sh alfworld [STAGE ...]    # full_context, fidelity, report (bench/learning.py)
# Needs .devenv (bash bench/device/env_bundle.sh here; carry .devenv): TextWorld, ALFWorld, pydantic, transformers
# 5.12.1 as wheels plus the ALFWorld archive (~28 MB), installed into /tmp/envsite once per machine. No SGLang:
# its bundle (46 MB repacked) and these (28 MB) do not fit one call's 64 MiB, so rollouts run on the built-in engine.
# State lives in /tmp/learning/ENV on the device: a stage already done there is skipped, an RL run cut by the time
# limit resumes from its last checkpoint (the evaluation points are checkpoints), as long as the machine stays warm
# between calls. Checkpoints never travel (the SFT model alone is ~300 MB); everything else comes back as
# $OUT/learning_ENV_state.tar.xz: carry it as .devlearn/learning_ENV_state.tar.xz and a fresh machine starts from
# it (finished runs kept; SFT done again, deterministically seeded, its hash recorded per run and compared).
# Budget (measured on the H200): games and model ~50 s; an SFT on the KV-streams rendering alone 322 s with its
# checks (stopped at step 120); each RL run 75 s of GPU time + ~1 min of evaluations and start-up. SFT on the three
# runs' renderings (2026-12-03: 6176 expert records) did not reach its stop within one call's 530 s while batches
# sampled records (a re-prefilled episode is a record per compaction); batches now take whole episodes from every
# rendering, not yet re-measured: a step is then 16 episodes of each (coin25 expert episodes, CPU-counted: 2.3k
# tokens as KV-streams or full context, 21.7k as re-prefill in 22.75 records; ~420k tokens a step). The bench stops
# at LEARNING_TIMEOUT (530 s) and writes its report; SFT ends 45 s before it, its state saved at that step (an RL run
# continues from its last evaluation): expect `all` to take two or three calls on one warm machine (call again
# within its idle release: it continues where it stopped).
# LEARNING_ENGINE=sglang: the RL runs generate on our SGLang server, one per run (bench.learning's [serving]; the
# first run's server starts during SFT, on the base checkpoint: its ~125 s of captures on a fresh H100 overlap SFT). The
# SGLang bundle (.device_sgl, 46 MB repacked) and .devenv (39 MB) do not fit one carry: first call with .devenv (installs the
# environments into /tmp/envsite, does SFT: `bash bench/device/learning_check.sh textworld sft`), then on the same
# warm machine `LEARNING_ENGINE=sglang bash bench/device/learning_check.sh textworld` carrying .device_sgl. Or all on
# one carry, for TextWorld: `bash bench/device/env_bundle.sh .devenv_tw textworld` (~5 MB) and
# `ENV_BUNDLE=.devenv_tw LEARNING_ENGINE=sglang bash bench/device/learning_check.sh textworld`, carrying .device_sgl
# and .devenv_tw (a fresh machine then needs no earlier call). The same for ALFWorld: `bash bench/device/env_bundle.sh
# .devenv_alf alfworld` (~9.4 MB: its wheels, fast-downward stripped, and its games) and `ENV_BUNDLE=.devenv_alf
# LEARNING_ENGINE=sglang bash bench/device/learning_check.sh alfworld`, carrying .device_sgl (repacked:
# bench/device/sglang_bundle_xz.sh), .devenv_alf, .devlearn and .devcache (66.2 of the 67.1 MB a call may carry).
# Results in $OUT (or bench/results/check): learning_ENV_CARD.json (CARD: the card the call got, h100 or h200), its
# PNG, the log, the state, the SGLang servers' logs (learning_ENV_server_logs.tar.xz), and
# jit_cache.tar.xz (the JIT caches, bench/device/jit_cache.sh: carry it as .devcache/jit_cache.tar.xz to skip the
# compiles next time).
set -o pipefail
ENV=$1
case $ENV in
  textworld|alfworld) shift ;;
  *) echo "usage: bash bench/device/learning_check.sh textworld|alfworld [STAGE ...]"; exit 2 ;;
esac
OUT=${OUT:-bench/results/check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source bench/device/envsite.sh || exit 1
SERVING=()
if [ "${LEARNING_ENGINE:-builtin}" = sglang ]; then  # the RL runs' rollouts on an SGLang server per run
  source bench/device/bundle.sh || exit 1  # carry .device_sgl (the environments are installed by an earlier call)
  export PYTHONPATH=$PYTHONPATH:/tmp/envsite
  SERVING=(--serving.engine sglang)
fi
if [ "$ENV" = alfworld ] && [ ! -d /tmp/alfworld_data/json_2.1.1 ]; then
  mkdir -p /tmp/alfworld_data && tar -xJf "${ENV_BUNDLE:-.devenv}"/alfworld-json_2.1.1-solvable.tar.xz -C /tmp/alfworld_data || exit 1
fi
STATE=/tmp/learning/$ENV
if [ ! -d "$STATE" ] && [ -f ".devlearn/learning_${ENV}_state.tar.xz" ]; then
  mkdir -p "$STATE" && tar -xJf ".devlearn/learning_${ENV}_state.tar.xz" -C "$STATE" && echo "state restored"
fi
# the SFT's expert episodes played on a CPU box, and their tokenizer (bash bench/device/sft_inputs.sh ENV; carry
# .devlearn); not over a base model already built here (its own tokenizer)
if [ -f ".devlearn/${ENV}_sft_inputs.tar.xz" ] && [ ! -f "$STATE/sft/expert_episodes.pt" ] \
    && [ ! -f "$STATE/model/config.json" ]; then
  tar -xJf ".devlearn/${ENV}_sft_inputs.tar.xz" -C /tmp && echo "expert episodes unpacked"
fi
export ALFWORLD_DATA=/tmp/alfworld_data KVSTREAMS_CACHE=/tmp/kvstreams_cache \
  LEARNING_DEVICE_COMMAND="bash bench/device/learning_check.sh $ENV $*"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
JSON="$OUT/learning_${ENV}_${DEVICE_CARD}.json"
# LEARNING_TIMEOUT: seconds for the stages (default 530); LEARNING_ARGS: config overrides for every stage (e.g. "--run.time_budget_s 150"); PYTHON: the interpreter
BENCH=(${PYTHON:-python3} -m bench.learning --config "configs/$ENV/gpu_small.toml" --out-dir "$STATE" --json "$JSON")
# SFT saves its state and the call ends cleanly 45 s before the limit (a check, ~26 s for ALFWorld's 32 games on an
# H100, and a checkpoint may follow the step that reaches it): the next call continues from that step. An RL run
# starts only with LEARNING_RUN_MIN_S left before that deadline (H100, 2026-12-07: a run's server 64-68 s, an
# ALFWorld evaluation point 48-77 s, a step ~15 s; TextWorld's ~30 s and ~7 s): a later start would be cut before
# its first checkpoint, and the next call would pay it again
case $ENV in alfworld) RUN_MIN=220 ;; *) RUN_MIN=140 ;; esac
LIMIT=${LEARNING_TIMEOUT:-530}
timeout $LIMIT "${BENCH[@]}" --stage "${@:-all}" "${SERVING[@]}" --deadline-s $((LIMIT - 45)) \
  --run-min-s ${LEARNING_RUN_MIN_S:-$RUN_MIN} $LEARNING_ARGS 2>&1 | tee "$OUT/learning_${ENV}.log"
rc=$?
[ $rc -eq 0 ] || timeout 40 "${BENCH[@]}" --stage report "${SERVING[@]}" $LEARNING_ARGS 2>&1 | tail -20  # what the cut call did
tar -cJf "$OUT/learning_${ENV}_state.tar.xz" -C "$STATE" --exclude=model --exclude=checkpoints --exclude=weights \
  --exclude=expert_episodes.pt --exclude='*.server.log' .  # small enough to carry beside .device_sgl
(cd "$STATE" && ls runs/*.server.log >/dev/null 2>&1 && tar -cJf "$OUT/learning_${ENV}_server_logs.tar.xz" runs/*.server.log)
jit_cache_save "$OUT"
exit $rc
