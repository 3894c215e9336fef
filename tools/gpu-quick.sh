#!/usr/bin/env bash
# Correctness pass on a GPU machine, shorter than gpu-check.sh: build, the GPU
# suite (fm-xval included), fm-train on CUDA next to CPU, and compute-sanitizer
# memcheck, racecheck, initcheck and synccheck, each over every GPU test (and
# memcheck over fm-xval -q), with one summary line per tool. Logs under $OUT.
#   FM_QUICK_STEPS   steps to run after the build (default "tests xval train sanitizers")
#   FM_SANITIZERS    tools to run (default "memcheck synccheck racecheck initcheck";
#                    FM_MEMCHECK=0 runs none)
#   FM_SANITIZER_BUDGET  seconds for all sanitizer runs together (default 480, shared
#                    equally by the tools): runs that do not fit are counted as not
#                    run, never dropped silently
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/gpu-common.sh gpu-quick-out
nvidia-smi --query-gpu=name --format=csv,noheader >>"$s"
gpu_build
steps=" ${FM_QUICK_STEPS:-tests xval train sanitizers} "
if [[ $steps == *" tests "* ]]; then
  names=$(meson test -C $B --suite gpu --list 2>/dev/null | awk -F: '{print $NF}' | grep -v '^fm-xval$')
  t 300 tests.log meson test -C $B --num-processes 1 --print-errorlogs $names
  grep -E "^ *[0-9]+/[0-9]+ " "$OUT/tests.log" >>"$s"
fi
if [[ $steps == *" xval "* ]]; then
  t 200 xval.log $B/tools/fm-xval
  grep -E "passed" "$OUT/xval.log" >>"$s"
fi
if [[ $steps == *" train "* ]]; then
  t 60 train.log $B/tools/fm-train --backend cuda --steps 6 --print-every 1 --out "$OUT/train-cuda"
  t 60 train.log $B/tools/fm-train --backend cpu --steps 6 --print-every 1 --out "$OUT/train-cpu"
fi
# sanitize TOOL PROGRAM [ARGS]: one run under compute-sanitizer (at most
# $san_cap s, default 120), its log appended to $OUT/TOOL.log; adds to the
# tool's counts (checked, errors, no summary, not run).
sanitize() {
  local tool=$1 cap=${san_cap:-120}; shift
  local lim=$((san_end - SECONDS)); [ $lim -gt $cap ] && lim=$cap
  if [ $lim -lt 10 ]; then notrun=$((notrun + 1)); echo "$tool $*: NOT RUN (budget spent)" >>"$s"; return; fi
  local log=$OUT/$tool-one.log
  # NCCL probes kernel images at init (API errors that are not ours). initcheck
  # does not see cuBLASLt's TMA stores and racecheck does not model its
  # mbarriers; racecheck also cannot run the native GEMM kernel (it stops
  # with an internal error), and only the first --kernel-name-exclude counts,
  # so racecheck leaves gm_kernel out and its reports inside cuBLASLt's
  # kernels (nvjet_*) are counted apart (RELIABILITY.md, eighth session).
  local opts=(--report-api-errors no)
  [ "$tool" = initcheck ] && opts+=(--kernel-name-exclude kns=nvjet)
  [ "$tool" = racecheck ] && opts+=(--kernel-name-exclude kns=gm_kernel)
  t $lim $tool-one.log compute-sanitizer --tool "$tool" "${opts[@]}" --error-exitcode 9 "$@"
  local rc=$? n
  cat "$log" >>"$OUT/$tool.log"
  # racecheck: reports naming a kernel outside cuBLASLt; the other tools: ERROR SUMMARY
  if [ "$tool" = racecheck ] && grep -q "RACECHECK SUMMARY" "$log"; then
    n=$(grep -A1 "Race reported" "$log" | grep "access at" | grep -vc "access at nvjet")
    foreign=$((foreign + $(grep -c "Race reported.*access at nvjet" "$log")))
  else
    n=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | grep -oE "[0-9]+" | tail -1)
  fi
  rm -f "$log"
  if [ -z "$n" ]; then nosum=$((nosum + 1)); echo "$tool $*: rc=$rc and no summary (timed out or crashed)" >>"$s"; return; fi
  checked=$((checked + 1)); errors=$((errors + n))
  [ $rc -eq 0 ] || [ $rc -eq 9 ] || echo "$tool $*: 0 sanitizer errors but the program returned rc=$rc" >>"$s"
}
san_tools=${FM_SANITIZERS-memcheck synccheck racecheck initcheck}
[ "${FM_MEMCHECK:-1}" = 1 ] || san_tools=""
[[ $steps == *" sanitizers "* ]] || san_tools=""
if [ -n "$san_tools" ] && ! command -v compute-sanitizer >/dev/null 2>&1; then
  echo "compute-sanitizer: NOT FOUND, no sanitizer run" >>"$s"; san_tools=""
fi
# Each tool gets an equal share of what is left of the budget, so that one
# slow tool cannot crowd out the others.
budget_end=$((SECONDS + ${FM_SANITIZER_BUDGET:-480}))
ntools=$(echo $san_tools | wc -w)
for tool in $san_tools; do
  san_end=$((SECONDS + (budget_end - SECONDS) / ntools)); ntools=$((ntools - 1))
  checked=0 errors=0 nosum=0 notrun=0 foreign=0
  for x in $B/tests/gpu/test_cuda_*; do [ -f "$x" ] && [ -x "$x" ] || continue
    sanitize "$tool" "$x"
  done
  [ "$tool" = memcheck ] && san_cap=200 sanitize "$tool" $B/tools/fm-xval -q
  extra=""
  [ "$tool" = racecheck ] && extra=", $foreign reports inside cuBLASLt kernels (not counted)"
  echo "compute-sanitizer $tool: $checked programs checked, $errors errors found, $nosum runs without a summary, $notrun not run (budget)$extra" >>"$s"
done
cat "$s"
