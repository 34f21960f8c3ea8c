#!/usr/bin/env bash
# One batched GPU session on a box without network (the team's `device` machine, or any CUDA host
# that has torch, triton, pytest, hypothesis and pandas but no engine wheels): the engines' kernel
# bandwidth table, the K3N-004/005 race reproducer, then the property suite on the GPU against the
# real engines (the K3-shape properties and the small-shape ones side by side), all written to OUT.
#
# Before (on a machine with network), put the extracted engine sources inside the repo:
#     K3NUM_ENGINE_CACHE=$PWD/engine-cache k3num fetch
#   and carry engine-cache/ without its wheels/ folder (about 0.5 MB).
# Usage: scripts/device_session.sh OUT [PARTS]
#   PARTS: comma-separated, any of ops,bench,race,k3,small,hunt,sanitize,golden,k3det,scale,stores,isolation,csrc,check,
#   checkops,ts,oracle,profile,derand,nightly,known,ranks,tokens,ledger,release,race7,contract,around,tpgemm,stream,
#   epilogue,markov,race4,models,extremes,mutate
#   `mutate` runs `k3num mutate` on a seeded sample per engine (K3NUM_MUTATE_ENGINES, K3NUM_MUTATE_SAMPLE 40) on every
#   core (cosmic-ray from the carried .whl/cosmic-ray wheelhouse), no mutant starting after K3NUM_MUTATE_DEADLINE s
#   (two thirds of K3NUM_MUTATE_TIMEOUT, 170): OUT/mutate.md, OUT/mutate-ENGINE.csv and .md.
#   `models` builds vLLM's ops and runs, on cuda under ci, the tests of the entries whose bug model only a GPU
#   shows (K3N-014: the compiled FP8 insert; K3N-008: SGLang's aggregation) and the write races' tests, each
#   with its ledger reproducer: every failure must be known (the model explains it) or the run says new.
#   OUT/models.log.
#   `race4` keeps every distinct output of K3N-004/005's write race on cases inside their rule
#   (scripts/collect_write_race.py, K3NUM_RACE4_CALLS calls each, default 300): OUT/write-race.pt and OUT/race4.log,
#   with the stale-row model's verdict on each output where the tree has it.
#   `markov` runs properties/test_markov.py on vLLM 0.34.0's fused Markov steps as compiled (the inline-PTX add, the
#   tensor-core dot): the small cases (K3NUM_MARKOV_PROFILE, default nightly-1k) and the K3-size test
#   (K3NUM_MARKOV_K3_PROFILE, default ci), then for each bug of scripts/markov_plants.py (K3NUM_MARKOV_PLANTS, default
#   all; K3NUM_MARKOV_PLANTS=none: no plant, not even the control) and its comment-only control the small cases
#   under ci (a plant stops at its first failing property): every plant must fail, the control pass
#   (K3NUM_MARKOV_PINNED=0 skips the pinned runs). OUT/markov.md is the table.
#   `epilogue` builds vLLM's ops (the default release's csrc, with the fused MLA prefill epilogue) and runs
#   properties/test_mla_epilogue.py on them (K3NUM_EPILOGUE_PROFILE, default nightly-1k), then for each bug of
#   scripts/mla_epilogue_plants.py (and its comment-only control) builds the planted checkout's ops and runs the
#   same properties under ci: every plant must fail them, the control pass. OUT/epilogue.md is the table.
#   `stream` runs `k3num impact --geometry k3 --stream-mismatch` on cuda (K3NUM_STREAM_ENGINES, default vllm,tokenspeed;
#   K3NUM_STREAM_CASES blocks, default 3): the flips and predicted flips of a draft served the other stream.
#   `tokens` times the draft step at K3 geometry (bench/draft_step_speed.py: examples/s per engine and drafter,
#   K3NUM_TOKENS_EXAMPLES, default 5; OUT/tokens-speed.csv), then runs the token properties on cuda under ci and
#   `k3num impact`, `k3num impact --ledger` and `k3num impact --geometry k3` (the nightly's K3 step) on cuda
#   (OUT/tokens-*.log, OUT/impact*.md). K3NUM_TOKENS_PROFILE=1 adds the torch profiler's tables of sglang's DSpark
#   step (OUT/tokens-profile.txt).
#   `tpgemm` asks whether vLLM 0.34.0's column-parallel context projection is exact on this GPU's GEMM at K3's
#   sizes (scripts/tp_gemm_exactness.py: every rank of TP 2, 4 and 8 in one process through the release's layer,
#   5 taps of 7168, 8/64/256 rows, against the replicated projection bit for bit and the float64 oracle), then
#   runs 0.34.0's quantized-loading properties and ledger reproducers on cuda. OUT/tp-gemm.csv, OUT/tpgemm.log.
#   `around` runs vllm-rocm's token properties on cuda under ci around K3N-001 (harness/around.py: the variant
#   vllm-rocm+fix-K3N-001, ROCm's tap fixed in a copy of the tree) on the pinned files (plain: xfail K3N-001;
#   variant: pass), on the planted score without the source's RMS (harness/fixes.py rocm-score-unnormalized:
#   the variant must fail) and on its control (must pass), then `k3num impact --engine vllm-rocm` on cuda on the
#   planted tree (exit 1, the variant's rows unlabelled) and the control (exit 0). OUT/around.log, OUT/around-*.csv.
#   `contract` runs the rounding contracts on cuda (properties/test_rounding_contracts.py: vLLM's AttnRes kernel
#   natively, its approximate rsqrt and exp inside the float32 bound; SGLang's draft K/V writer) under
#   K3NUM_CONTRACT_PROFILE (nightly-1k) on the pinned files, one pytest per engine under K3NUM_CONTRACT_TIMEOUT
#   (240 s each: vLLM's contract alone takes about 126 s at nightly-1k on the H200, run 93), then under ci on
#   the planted roundings (harness/fixes.py attn-res-mixture-bf16, draft-kv-inv-bf16: must fail) and their
#   controls (must pass), each with its drift CSV's median rounding count.
#   OUT/contract-pinned.log (the failures and summary lines of every run) and OUT/contract-*.csv.
#   `race7` checks K3N-007's bug model on the H200 at K3's hidden 7168 (the per-segment search beyond 8 segments):
#   scripts/explain_attn_res_race.py on K3-shape cases (K3NUM_RACE7_CASES, ';'-separated), then the K3-shape repeat
#   property on vllm-rocm at each pinned release (K3NUM_RACE7_PROFILE, default ci) and the in-place prefix property
#   (K3N-007's own, small shapes, 152 calls per case) K3NUM_RACE7_REPEATS times, then the small-shape accuracy
#   property on vllm-rocm@0.34.0 under 4 xdist workers K3NUM_RACE7_REPEATS times (3): every failing case must be
#   known. OUT/race7-*.log.
#   `ledger` builds vLLM's ops (`k3num build-ops`, for K3N-014's FP8 insert) and runs `k3num impact --ledger` on cuda
#   (K3NUM_LEDGER_CASES, default 10): every entry's case class through the draft step, the races K3N-004/005/007
#   among them, which the CPU cannot run (OUT/impact-ledger-gpu.md and .csv, OUT/ledger.log).
#   `release` runs another pinned vLLM release (K3NUM_RELEASE, default 0.34.0; carry engine-cache/vllm-RELEASE) on
#   cuda: the K3-shape suite (K3NUM_K3_PROFILE) and the small-shape suite (K3NUM_SMALL_PROFILE) on vllm@RELEASE and
#   vllm-rocm@RELEASE, then every ledger reproducer there (OUT/release-*.log, OUT/release-k3/, OUT/release-small/).
#   `ranks` runs each PP stage as its own rank on NCCL, one GPU per rank (properties/test_pp_ranks.py --device cuda:
#   2 and 4 ranks where as many GPUs are visible; the world sizes beyond them skip saying so). OUT/ranks.log.
#   `known` runs the in-place prefix rewrite property (K3N-007's race on vllm-rocm) under nightly-1k on vllm and
#   vllm-rocm, unsharded and then with --shards 4 over 4 xdist workers: every failing case must be reported known
#   (xfailed, naming K3N-007), none failed (issue 32). OUT/known-*.log.
#   `oracle` times the float64 oracles at K3 shapes against the fp64 GEMM and the copy rate (bench/oracle_throughput.py,
#   K3NUM_ORACLE_REPS, K3NUM_ORACLE_ONLY, K3NUM_ORACLE_PROFILE=1 for the profiler's tables in OUT/oracle-profile.txt);
#   with K3NUM_ORACLE_BITS_ROOT=TREE (another checkout's root) it also compares the oracle's and the judges' values
#   with TREE's, bit for bit, on this GPU (scripts/oracle_bits.py).
#   `profile` runs bench/suite_profile.py --examples K3NUM_PROFILE_EXAMPLES (100): examples/s and the phase shares.
#   `derand` runs the K3-shape suite derandomized (K3NUM_DERAND_PROFILE, default ci) and, with
#   K3NUM_DERAND_BEFORE=CSV, compares its drift CSV with that one record for record (scripts/csv_identity.py).
#   `nightly` runs the K3-shape suite under K3NUM_NIGHTLY_PROFILE (default nightly: 10,000 examples per property)
#   with gpu_nightly.sh (its K3NUM_SHARDS, K3NUM_WORKERS_PER_GPU; K3NUM_TIMEOUT bounds it) and prints every test's
#   examples, seconds and examples/s (scripts/nightly_rates.py: OUT/nightly.md).
#   `ts` runs TokenSpeed on cuda (tokenspeed-kernel's Triton kernels natively; its CUDA rope.so through tvm_ffi,
#   installed from engine-cache/runtime-wheels when missing): every property at small shapes (K3NUM_TS_SMALL_PROFILE,
#   default ci) and the K3-shape ones (K3NUM_TS_K3_PROFILE, default nightly-1k), timed, to OUT/ts-*.csv.
#   `checkops` runs `k3num check` on vLLM's built ops (one process per side): the pinned files against the pinned
#   release, a checkout whose csrc/ was rebuilt (a comment added to cache_kernels.cu: nothing new, and the time
#   it adds is its build), and that checkout with a bug planted in the grouped cache insert (the last k_pe
#   element of every entry not written: new). OUT/checkops.md is the table (K3NUM_CHECKOPS_K, the -k selection;
#   K3NUM_CHECKOPS_TIMEOUT seconds per check, default 150).
#   `check` runs `k3num check` on cuda (Triton natively): the pinned vLLM bytes against themselves on the attn_res
#   properties, where the write races K3N-004/005/007 live (nothing new may be reported), a planted mixture bug
#   (harness/fixes.py mixture-scaled: new), and bench/check_speed.py (check against a plain run).
#   `csrc` builds vLLM's ops from the pinned sdist and then from a checkout's csrc (the pinned files laid out as
#   a checkout, cache_kernels.cu edited: `k3num build-ops --engine-src vllm=TREE`), timing both, and runs the
#   context-KV properties on the checkout's ops.
#   `stores` captures the bf16 stores of the pinned Triton kernels on stored inputs
#   (`python -m k3num.harness.store_golden capture OUT/bf16_stores_h200.safetensors`: what the CPU
#   interpreter's rounding is checked against, tests/test_interpreter_rounding.py).
#   `isolation` plants a bug in one SGLang kernel and runs the suite on it (scripts/gpu_isolation.py):
#   the control (pinned files), a wrong mixture, an illegal address; K3NUM_ISOLATION_PROFILE (ci),
#   K3NUM_ISOLATION_TIMEOUT seconds each (240), K3NUM_ISOLATION_PLANTS (none combine-scaled
#   combine-illegal-address combine-illegal-address@xdist: NAME@xdist under xdist with 2 workers),
#   K3NUM_ISOLATION_PEAK_GIB the peak CUDA memory a test may reach (0: report only).
#   (default: bench,race,k3,small).
#   `golden` times the golden-set judge against the live float64 oracle at K3 shapes (bench/golden_speed.py).
#   `k3det` runs the K3-shape determinism property (152 calls per example) under K3NUM_K3DET_PROFILE
#   (default nightly-1k) on vllm and vllm-rocm, spread by xdist (K3NUM_K3DET_WORKERS, default 4).
#   `scale` runs the K3-shape properties (K3NUM_K3_PROFILE) once per worker count in K3NUM_SCALE_WORKERS
#   (default "1 4 8", gpu_nightly.sh's K3NUM_WORKERS) and, where K3NUM_SCALE_BASELINE names a script,
#   once with that script first (an older gpu_nightly.sh, for a side-by-side time, with the jobs in
#   K3NUM_SCALE_BASELINE_JOBS); K3NUM_SCALE_K, a pytest -k expression, narrows the xdist runs (write the
#   same into the baseline's ENGINE@KEXPR jobs); OUT/scale.md is the table.
#   `hunt` runs the determinism, poisoned-memory and off-path-shape properties on cuda for the real engines
#   (K3NUM_HUNT_PROFILE, default ci: 152 calls per determinism case), the flaky-race reproducer with K3N-007's
#   mechanism check and lead 2's variants, and scripts/prove_fixes.py (each ledger fix on a patched copy).
#   `sanitize` runs scripts/gpu_sanitize.py (every kernel subject under memcheck, racecheck, initcheck and
#   synccheck; compute-sanitizer from PATH or /usr/local/cuda/bin). `ops` builds
#   vLLM's CUDA ops of each release in K3NUM_OPS_RELEASES (default "0.34.0 0.33.0") from the carried csrc
#   (engine-cache/vllm-RELEASE-csrc; `k3num build-ops --engine-src vllm=<that release's cache tree>`), times the
#   fused context-KV path against the unfused one with them (bench/context_kv_speed.py), and runs the
#   context-KV properties on them (mode source-gpu+ops) at small shapes (K3NUM_OPS_SMALL_PROFILE,
#   default ci) and K3 shapes (K3NUM_OPS_K3_PROFILE, default nightly-1k). (k3 and small run side by
#   side when both are asked for; on the recorded H200 run that contention cost ~3x in K3 examples,
#   so a 10-minute slot should take k3 alone)
# Environment (docs/gpu-run.md records the settings of each recorded run):
#   K3NUM_K3_PROFILE     profile of the K3-shape properties (nightly-1k: 1,000 examples each)
#   K3NUM_K3_ENGINES     their engines (default: vllm vllm-rocm sglang tokenspeed)
#   K3NUM_SMALL_PROFILE  profile of the small-shape properties on cuda (ci: 40 examples each)
#   K3NUM_SMALL_ENGINES  their engines (default: vllm vllm-rocm sglang tokenspeed)
#   K3NUM_TIMEOUT        seconds after which a gpu_nightly.sh run is interrupted (default 480)
#   K3NUM_BENCH_REPS     repetitions of each kernel timing (default 20)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: scripts/device_session.sh OUT [PARTS]}
parts=",${2:-bench,race,k3,small},"
want() { [[ "$parts" == *",$1,"* ]]; }
for p in ${parts//,/ }; do
    case $p in ops|bench|race|k3|small|hunt|sanitize|golden|k3det|scale|stores|isolation|csrc|check|checkops|ts|oracle|profile|derand|nightly|known|ranks|tokens|ledger|release|race7|contract|around|tpgemm|stream|epilogue|markov|race4|models|extremes|mutate) ;;
        *) echo "device_session: unknown part '$p' (ops, bench, race, k3, small, hunt, sanitize, golden, k3det, scale, stores, isolation, csrc, check, checkops, ts, oracle, profile, derand, nightly, known, ranks, tokens, ledger, release, race7, contract, around, tpgemm, stream, epilogue, markov, race4, models, extremes, mutate)"
           exit 2;; esac
done
mkdir -p "$out"
cd "$root"
export K3NUM_ENGINE_CACHE=${K3NUM_ENGINE_CACHE:-$root/engine-cache} PYTHONUNBUFFERED=1
export K3NUM_TIMEOUT=${K3NUM_TIMEOUT:-480}
k3_profile=${K3NUM_K3_PROFILE:-nightly-1k}
k3_engines=${K3NUM_K3_ENGINES:-vllm vllm-rocm sglang tokenspeed}
small_profile=${K3NUM_SMALL_PROFILE:-ci}
small_engines=${K3NUM_SMALL_ENGINES:-vllm vllm-rocm sglang tokenspeed}
{
    date -u +"%F %T UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python -c "import torch, triton, hypothesis; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'hypothesis', hypothesis.__version__)"
} | tee "$out/env.txt"
for e in vllm-0.34.0 vllm-0.33.0 sglang-0.5.23 tokenspeed-0.1.1; do
    [ -f "$K3NUM_ENGINE_CACHE/$e/MANIFEST.json" ] || { echo "missing $K3NUM_ENGINE_CACHE/$e (carry it)"; exit 2; }
done
mutate=0 extremes=0 models=0 race4=0 markov=0 epilogue=0 stream=0 tpgemm=0 around=0 contract=0 race7=0 release=0 ledger=0 tokens=0 ranks=0 known=0 bench=0 race=0 k3=0 small=0 ops=0 hunt=0 sanitize=0 golden=0 k3det=0 scale=0 stores=0 isolation=0 csrc=0 check=0 checkops=0 ts=0 oracle=0 profile=0 derand=0 nightly=0
if want tokens; then
    echo "== the draft step at K3 geometry, the token properties and k3num impact on cuda"
    timeout -s INT "${K3NUM_TOKENS_BENCH_TIMEOUT:-200}" python bench/draft_step_speed.py --geometry k3 \
        --examples "${K3NUM_TOKENS_EXAMPLES:-5}" --csv "$out/tokens-speed.csv" 2>&1 | tee "$out/tokens-speed.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || tokens=1
    if [ "${K3NUM_TOKENS_PROFILE:-0}" = 1 ]; then  # the profiler's tables of one (engine, drafter): where the step waits
        timeout -s INT 120 python bench/draft_step_speed.py --geometry k3 --profile --engines sglang --kinds dspark \
            > "$out/tokens-profile.txt" 2>&1 || tokens=1
    fi
    timeout -s INT "${K3NUM_TOKENS_PROPS_TIMEOUT:-120}" python -m pytest properties/test_draft_tokens.py --device cuda \
        -p no:cacheprovider -q -rs --hypothesis-profile ci --drift-csv "$out/tokens.csv" 2>&1 | tail -n 25 \
        | tee "$out/tokens-props.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || tokens=1
    timeout -s INT 60 python -m k3num.harness.cli impact --device cuda --cases 10 > "$out/impact.md" 2> "$out/impact.err"
    echo "impact exit $?" | tee -a "$out/tokens-props.log"
    timeout -s INT 60 python -m k3num.harness.cli impact --ledger --device cuda --cases 10 > "$out/impact-ledger.md" 2>> "$out/impact.err"
    echo "impact --ledger exit $?" | tee -a "$out/tokens-props.log"
    # the nightly's K3-geometry step (gpu_nightly.sh, K3NUM_IMPACT_K3_CASES): its wall time and exit here first
    t0=$SECONDS
    timeout -s INT 240 python -m k3num.harness.cli impact --geometry k3 --device cuda --cases 3 \
        > "$out/impact-k3.md" 2>> "$out/impact.err"
    echo "impact --geometry k3 exit $? in $((SECONDS - t0)) s" | tee -a "$out/tokens-props.log"
fi
if want stream; then
    # the aux stream as a knob at K3 geometry: a draft trained on the AttnRes mixture served vLLM's default prefix
    # sum, and the reverse (k3num impact --stream-mismatch; issue 40), K3NUM_STREAM_CASES blocks per engine
    echo "== the stream mismatch at K3 geometry on cuda (engines: ${K3NUM_STREAM_ENGINES:-vllm,tokenspeed})"
    t0=$SECONDS
    timeout -s INT "${K3NUM_STREAM_TIMEOUT:-240}" python -m k3num.harness.cli impact --geometry k3 --device cuda \
        --stream-mismatch --engine "${K3NUM_STREAM_ENGINES:-vllm,tokenspeed}" --cases "${K3NUM_STREAM_CASES:-3}" \
        --format csv > "$out/impact-stream.csv" 2> "$out/impact-stream.err"
    rc=$?
    echo "impact --geometry k3 --stream-mismatch exit $rc in $((SECONDS - t0)) s" | tee "$out/stream.log"
    [ "$rc" -eq 0 ] || stream=1
    python -c "import sys, pandas as pd; t = pd.read_csv(sys.argv[1]); print(t[[c for c in ('engine', 'drafter', \
'trained_stream', 'served_stream', 'positions', 'diverged', 'decided_share', 'worst_err_over_delta', \
'q99_err_over_delta', 'predicted_flips', 'severity') if c in t]].to_string(index=False))" "$out/impact-stream.csv" \
        | tee -a "$out/stream.log"
fi
if want release; then
    # another pinned release (K3NUM_RELEASE, default vllm's 0.34.0) on cuda: the K3-shape suite (K3NUM_K3_PROFILE),
    # the small-shape suite (K3NUM_SMALL_PROFILE) and every ledger reproducer, each record naming the release read
    rel=${K3NUM_RELEASE:-0.34.0}
    [ -f "$K3NUM_ENGINE_CACHE/vllm-$rel/MANIFEST.json" ] || { echo "missing $K3NUM_ENGINE_CACHE/vllm-$rel (carry it)"; exit 2; }
    echo "== vllm $rel on cuda: K3 shapes [$k3_profile], small shapes [$small_profile], the ledger reproducers"
    t0=$SECONDS
    K3NUM_PROFILE=$k3_profile K3NUM_SUITE="properties -m gpu" K3NUM_ENGINES="vllm@$rel vllm-rocm@$rel" \
        K3NUM_IMPACT_K3_CASES=0 bash scripts/gpu_nightly.sh "$out/release-k3" > "$out/release-k3.log" 2>&1 || release=1
    echo "K3 shapes exit $release in $((SECONDS - t0)) s" | tee -a "$out/release.log"
    t0=$SECONDS
    K3NUM_PROFILE=$small_profile K3NUM_SUITE="properties --ignore=properties/test_k3_shapes.py" \
        K3NUM_ENGINES="vllm@$rel vllm-rocm@$rel" K3NUM_IMPACT_K3_CASES=0 \
        bash scripts/gpu_nightly.sh "$out/release-small" > "$out/release-small.log" 2>&1 || release=1
    echo "small shapes exit $release in $((SECONDS - t0)) s" | tee -a "$out/release.log"
    t0=$SECONDS
    timeout -s INT "${K3NUM_RELEASE_REPRO_TIMEOUT:-200}" python -m pytest properties/test_ledger_reproducers.py \
        --engine "vllm@$rel,vllm-rocm@$rel" --device cuda -p no:cacheprovider -q -rfEsx > "$out/release-repro.log" 2>&1 \
        || release=1
    echo "ledger reproducers exit $release in $((SECONDS - t0)) s" | tee -a "$out/release.log"
    tail -n 25 "$out/release-k3.log" "$out/release-small.log" "$out/release-repro.log"
fi
if want epilogue; then
    echo "== vLLM's fused MLA prefill epilogue on its built ops: pinned, each planted bug, the control"
    [ -f "$K3NUM_ENGINE_CACHE/vllm-0.34.0-csrc/MANIFEST.json" ] || { echo "missing $K3NUM_ENGINE_CACHE/vllm-0.34.0-csrc (carry it)"; exit 2; }
    ep_run() {  # label, want, profile, [--engine-src ...]: build, run, append a table row
        local label=$1 want=$2 profile=$3; shift 3; local t0=$SECONDS
        python -m k3num.harness.cli build-ops --jobs "$(nproc)" "$@" > "$out/epilogue-build-$label.log" 2>&1
        local b=$?
        timeout -s INT "${K3NUM_EPILOGUE_TIMEOUT:-200}" python -m pytest properties/test_mla_epilogue.py --engine vllm \
            "$@" --device cuda -p no:cacheprovider -q -rfEsx --hypothesis-profile="$profile" \
            --drift-csv "$out/epilogue-$label.csv" > "$out/epilogue-$label.log" 2>&1
        local rc=$?
        echo "| $label | $b | $rc | $want | $profile | $((SECONDS - t0)) |" >> "$out/epilogue.md"
        grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|source-gpu|^E  " "$out/epilogue-$label.log" | cut -c1-300 | head -n 12
        if [ "$b" -ne 0 ] || { [ "$want" = pass ] && [ "$rc" -ne 0 ]; } || { [ "$want" = fail ] && [ "$rc" -ne 1 ]; }; then
            epilogue=1
        fi
    }
    printf '| tree | build exit | pytest exit | want | profile | s |\n| --- | --- | --- | --- | --- | --- |\n' > "$out/epilogue.md"
    ep_run pinned pass "${K3NUM_EPILOGUE_PROFILE:-nightly-1k}"
    trees=/tmp/k3num-epilogue; rm -rf "$trees"
    python scripts/mla_epilogue_plants.py "$trees" ${K3NUM_EPILOGUE_PLANTS:-} > /dev/null || epilogue=1
    for tree in "$trees"/*; do
        name=$(basename "$tree"); want=fail; [ "$name" = control ] && want=pass
        ep_run "$name" "$want" ci --engine-src "vllm=$tree"
    done
    cat "$out/epilogue.md"
fi
if want markov; then
    echo "== vLLM 0.34.0's fused Markov steps on cuda: pinned (small cases, K3 sizes), each planted bug, the control"
    mk_run() {  # label, want, profile, -k expression, [--engine-src ...]: run, append a table row
        local label=$1 want=$2 profile=$3 sel=$4; shift 4; local t0=$SECONDS
        [ "$want" = fail ] && set -- "$@" --maxfail=1  # a plant needs one failing property, not all of them
        timeout -s INT "${K3NUM_MARKOV_TIMEOUT:-240}" python -m pytest properties/test_markov.py --engine vllm "$@" \
            --device cuda -p no:cacheprovider -q -rfEsx --hypothesis-profile="$profile" -k "$sel" \
            --drift-csv "$out/markov-$label.csv" > "$out/markov-$label.log" 2>&1
        local rc=$?
        echo "| $label | $rc | $want | $profile | $sel | $((SECONDS - t0)) |" >> "$out/markov.md"
        grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|source-gpu|^E  " "$out/markov-$label.log" | cut -c1-300 | head -n 12
        if { [ "$want" = pass ] && [ "$rc" -ne 0 ]; } || { [ "$want" = fail ] && [ "$rc" -ne 1 ]; }; then
            markov=1
        fi
    }
    printf '| tree | pytest exit | want | profile | tests | s |\n| --- | --- | --- | --- | --- | --- |\n' > "$out/markov.md"
    if [ "${K3NUM_MARKOV_PINNED:-1}" = 1 ]; then  # 0: the plants alone
        mk_run pinned pass "${K3NUM_MARKOV_PROFILE:-nightly-1k}" "not test_k3_"
        mk_run pinned-k3 pass "${K3NUM_MARKOV_K3_PROFILE:-ci}" "test_k3_"
    fi
    trees=/tmp/k3num-markov; rm -rf "$trees"; mkdir -p "$trees"
    if [ "${K3NUM_MARKOV_PLANTS:-}" != none ]; then
        python scripts/markov_plants.py "$trees" ${K3NUM_MARKOV_PLANTS:-} > /dev/null || markov=1
    fi
    for tree in "$trees"/*; do
        [ -d "$tree" ] || continue
        name=$(basename "$tree"); want=fail; [ "$name" = control ] && want=pass
        mk_run "$name" "$want" ci "not test_k3_" --engine-src "vllm=$tree"
    done
    cat "$out/markov.md"
fi
if want tpgemm; then
    echo "== vLLM 0.34.0's column-parallel context projection on this GPU's GEMM, and its quantized loaders"
    {
        date -u +"%F %T UTC"
        timeout -s INT 300 python scripts/tp_gemm_exactness.py --device cuda --csv "$out/tp-gemm.csv" || tpgemm=1
        timeout -s INT 200 python -m pytest properties/test_quantized_loading.py properties/test_ledger_reproducers.py \
            properties/test_tp_ranks.py --engine vllm@0.34.0 --device cuda -p no:cacheprovider -q -rfEsx \
            --hypothesis-profile=ci 2>&1 | grep -E "^(FAILED|ERROR|XFAIL|XPASS|SKIPPED)|passed|failed" | cut -c1-240
        [ "${PIPESTATUS[0]}" -eq 0 ] || tpgemm=1
    } > "$out/tpgemm.log" 2>&1  # not a pipe: `tpgemm` is set in this shell
    cat "$out/tpgemm.log"
fi
if want around; then
    echo "== around K3N-001 on cuda: vllm-rocm's token properties and k3num impact, pinned, planted, control"
    {
        date -u +"%F %T UTC"
        # TREE:the pytest exit it must give (pinned and control: 0, the variant passes; planted: 1)
        for t in pinned:0 rocm-score-unnormalized:1 rocm-attn-res-control:0; do
            fid=${t%%:*} want_rc=${t#*:} src=()
            if [ "$fid" != pinned ]; then
                tree=$(python -c "import sys; from pathlib import Path; from k3num.harness import fixes; \
print(fixes.patched_tree(fixes.by_id(sys.argv[1]), Path(sys.argv[2])))" "$fid" "$out/tree-$fid")
                src=(--engine-src "vllm=$tree")
            fi
            start=$(date +%s)
            timeout -s INT "${K3NUM_AROUND_TIMEOUT:-200}" python -m pytest properties/test_draft_tokens.py \
                --engine vllm-rocm "${src[@]}" --device cuda -p no:cacheprovider -q -rfEx --hypothesis-profile=ci \
                --drift-csv "$out/around-$fid.csv" > "$out/around-$fid.log" 2>&1
            rc=$?
            echo "$fid tokens: pytest exit $rc (wanted $want_rc), $(( $(date +%s) - start )) s"
            if [ "$rc" -ne "$want_rc" ]; then around=1; fi
            grep -E "^(FAILED|XFAIL|XPASS|ERROR)|passed|failed|vllm-rocm\+fix" "$out/around-$fid.log" | cut -c1-240
            if [ "$fid" != pinned ]; then
                start=$(date +%s)
                timeout -s INT "${K3NUM_AROUND_TIMEOUT:-200}" python -m k3num.harness.cli impact --engine vllm-rocm \
                    "${src[@]}" --device cuda --cases "${K3NUM_AROUND_CASES:-8}" > "$out/around-impact-$fid.md" 2>&1
                rc=$?
                echo "$fid impact: exit $rc (wanted $want_rc), $(( $(date +%s) - start )) s"
                if [ "$rc" -ne "$want_rc" ]; then around=1; fi
                grep -E "vllm-rocm" "$out/around-impact-$fid.md" | cut -c1-240
                rm -rf "$out/tree-$fid"
            fi
            rm -f "$out/around-$fid.log"
        done
    } > "$out/around.log" 2>&1  # not a pipe: `around` is set in this shell
    cat "$out/around.log"
    rm -f "$out"/around-impact-*.md
fi
if want contract; then
    echo "== rounding contracts on cuda"
    t0=$SECONDS
    # one pytest per engine, each under its own limit: the three engines in one run at nightly-1k took more than
    # 240 s on the H200 and were cut short before SGLang's accuracy properties ran (runs 91-92)
    : > "$out/contract-pinned.log"
    for eng in vllm tokenspeed sglang; do
        timeout -s INT "${K3NUM_CONTRACT_TIMEOUT:-240}" python -m pytest properties/test_rounding_contracts.py \
            properties/test_attn_res.py properties/test_draft_kv.py \
            -k "rounds_only_where or within_rounding_budget_of_oracle" --engine "$eng" --device cuda \
            -p no:cacheprovider -q -rfEsx --hypothesis-profile="${K3NUM_CONTRACT_PROFILE:-nightly-1k}" \
            --drift-csv "$out/contract-pinned-$eng.csv" > "$out/contract-pinned-$eng.log" 2>&1
        rc=$?
        echo "pinned $eng: pytest exit $rc" | tee -a "$out/contract-pinned.log"
        if [ "$rc" -ne 0 ]; then contract=1; fi
        grep -E "^(FAILED|ERROR|XFAIL|XPASS)|passed|failed" "$out/contract-pinned-$eng.log" | cut -c1-300 \
            | tee -a "$out/contract-pinned.log"
        rm -f "$out/contract-pinned-$eng.log"
    done
    # FIX:ENGINE:the pytest exit it must give (1: the contract fails; 0: the control passes)
    for plant in attn-res-mixture-bf16:vllm:1 attn-res-control:vllm:0 draft-kv-inv-bf16:sglang:1 \
                 draft-kv-control:sglang:0; do
        fid=${plant%%:*} eng=${plant#*:}; want_rc=${eng#*:} eng=${eng%%:*}
        tree=$(python -c "import sys; from pathlib import Path; from k3num.harness import fixes; \
print(fixes.patched_tree(fixes.by_id(sys.argv[1]), Path(sys.argv[2])))" "$fid" "$out/tree-$fid")
        timeout -s INT 120 python -m pytest properties/test_rounding_contracts.py properties/test_attn_res.py \
            properties/test_draft_kv.py -k "rounds_only_where or within_rounding_budget_of_oracle" --engine "$eng" \
            --engine-src "$eng=$tree" \
            --device cuda -p no:cacheprovider -q -rfEx --hypothesis-profile=ci --drift-csv "$out/contract-$fid.csv" \
            > "$out/contract-$fid.log" 2>&1
        rc=$?
        rm -rf "$out/tree-$fid"
        echo "$fid: pytest exit $rc" | tee -a "$out/contract-pinned.log"
        if [ "$rc" -ne "$want_rc" ]; then contract=1; fi
        grep -E "rounds where|passed|failed" "$out/contract-$fid.log" | head -n 3 | tee -a "$out/contract-pinned.log"
        rm -f "$out/contract-$fid.log"
    done
    python - "$out" <<'PY'
import sys
from pathlib import Path
import pandas as pd
for f in sorted(Path(sys.argv[1]).glob("contract-*.csv")):
    d = pd.read_csv(f)
    d = d[d["verdict"].isin(["pass", "fail"])]
    print(f.name, d.groupby(["engine", "property"])["roundings"].median().round(3).to_dict())
PY
    echo "contract: exit $contract in $((SECONDS - t0)) s" | tee -a "$out/contract-pinned.log"
fi
if want race7; then
    echo "== K3N-007's model at K3 shapes: the explanation of each raced output, the repeat property, the accuracy one"
    t0=$SECONDS
    IFS=';' read -ra cases <<< "${K3NUM_RACE7_CASES:-tokens=6,hidden=7168,bank=9,num_blocks=4,block_write_idx=4,seed=1,scale=1.0;tokens=6,hidden=7168,bank=9,num_blocks=4,seed=2,scale=1.0;tokens=33,hidden=7168,bank=9,num_blocks=8,block_write_idx=8,seed=3,scale=1.0}"
    for c in "${cases[@]}"; do
        timeout -s INT 120 python scripts/explain_attn_res_race.py --calls 152 --case "$c" 2>&1 | tail -n 80 \
            >> "$out/race7-explain.log" || race7=1
    done
    grep -E "^vllm|distinct|^model" "$out/race7-explain.log"
    for rel in 0.33.0 0.34.0; do
        timeout -s INT 200 python -m pytest properties/test_k3_shapes.py -k "repeated_calls and rocm" \
            --engine "vllm-rocm@$rel" -n 4 --dist worksteal -p no:cacheprovider -q -rfEx --device cuda \
            --hypothesis-profile="${K3NUM_RACE7_PROFILE:-ci}" > "$out/race7-k3det-$rel.log" 2>&1 || race7=1
        tail -n 4 "$out/race7-k3det-$rel.log"
        for i in $(seq "${K3NUM_RACE7_REPEATS:-3}"); do
            timeout -s INT 150 python -m pytest properties/test_determinism.py -k "in_place_prefix and rocm" \
                --engine "vllm-rocm@$rel" -n 4 -p no:cacheprovider -q -rfEx --device cuda --hypothesis-profile=ci \
                > "$out/race7-inplace-$rel-$i.log" 2>&1 || race7=1
            tail -n 2 "$out/race7-inplace-$rel-$i.log"
        done
    done
    for i in $(seq "${K3NUM_RACE7_REPEATS:-3}"); do
        timeout -s INT 120 python -m pytest properties/test_attn_res.py -k "within_rounding_budget and rocm" \
            --engine vllm-rocm@0.34.0 -n 4 -p no:cacheprovider -q -rfEx --device cuda --hypothesis-profile=ci \
            > "$out/race7-accuracy-$i.log" 2>&1 || race7=1
        tail -n 3 "$out/race7-accuracy-$i.log"
    done
    echo "race7: exit $race7 in $((SECONDS - t0)) s" | tee -a "$out/race7-explain.log"
fi
if want mutate; then
    # mutants per minute on this box's cores (issue: scale) and a seeded sample's score per engine: cosmic-ray
    # from the carried wheelhouse (.whl/cosmic-ray, made by `pip download` on a machine with network), k3num's
    # operators registered by a dist-info on PYTHONPATH (the checkout is not installed here)
    echo "== mutation samples on $(nproc) cores (engines: ${K3NUM_MUTATE_ENGINES:-tokenspeed vllm sglang})"
    site=$(mktemp -d)
    if ! python -c "import cosmic_ray" 2>/dev/null; then
        pip install -q --no-index --find-links "$root/.whl/cosmic-ray" --target "$site" cosmic-ray==8.7.0 \
            > "$out/mutate-install.log" 2>&1 || mutate=1
    fi
    mkdir -p "$site/k3num_operators-0.dist-info"
    printf 'Metadata-Version: 2.1\nName: k3num-operators\nVersion: 0\n' > "$site/k3num_operators-0.dist-info/METADATA"
    printf '[cosmic_ray.operator_providers]\nk3num = k3num.harness.mutation_operators:Provider\n' \
        > "$site/k3num_operators-0.dist-info/entry_points.txt"
    export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
    work=$(mktemp -d)
    for e in ${K3NUM_MUTATE_ENGINES:-tokenspeed vllm sglang}; do
        t0=$SECONDS
        # no mutant starts after the deadline (two thirds of the timeout): the report covers what ran
        lim=${K3NUM_MUTATE_TIMEOUT:-170}
        timeout -s INT "$lim" python -m k3num.harness.cli mutate --engine "$e" \
            --sample "${K3NUM_MUTATE_SAMPLE:-40}" --seed "${K3NUM_MUTATE_SEED:-0}" --workers "$(nproc)" \
            --deadline "${K3NUM_MUTATE_DEADLINE:-$((lim * 2 / 3))}" --out "$work/$e" > "$out/mutate-$e.log" 2>&1
        rc=$?
        [ "$rc" -le 1 ] || mutate=1
        cp "$work/$e/mutants.csv" "$out/mutate-$e.csv" 2>/dev/null; cp "$work/$e/report.md" "$out/mutate-$e.md" 2>/dev/null
        echo "mutate $e: exit $rc in $((SECONDS - t0)) s on $(nproc) workers" | tee -a "$out/mutate.md"
        tail -n 3 "$out/mutate-$e.log" | cut -c1-300 | tee -a "$out/mutate.md"
    done
fi
if want extremes; then
    echo "== the extremes on cuda: scores past exp's range, massive/tiny/mixed magnitudes, the tap's lifetime, batch"
    echo "   composition (every row-independent subject; attn_res across vLLM's tiling switch at 256 tokens), pinned"
    echo "   on every engine, then each kernel plant of them and its control"
    t0=$SECONDS
    timeout -s INT "${K3NUM_EXTREMES_TIMEOUT:-240}" python -m pytest properties/test_extreme_scores.py \
        properties/test_magnitudes.py properties/test_batch_composition.py properties/test_aux_tap.py \
        --engine vllm,vllm-rocm,sglang,tokenspeed \
        --device cuda --hypothesis-profile=ci -q -rxXfE -p no:cacheprovider --drift-csv "$out/extremes.csv" \
        > "$out/extremes.log" 2>&1 || extremes=1
    grep -E "^(XFAIL|FAILED|ERROR)|passed|failed" "$out/extremes.log" | cut -c1-400 | tee -a "$out/extremes.md"
    PYTEST_ADDOPTS="--device cuda" timeout -s INT "${K3NUM_EXTREMES_PLANTS_TIMEOUT:-240}" python scripts/prove_fixes.py \
        --mutants --fix combine-softmax-without-max --fix online-softmax-without-max \
        --fix prefix-tap-aliases-the-running-prefix --fix rocm-bank-clamped-to-fp16 \
        --fix eager-mixture-max-over-the-batch --out "$out/extremes-plants" 2>&1 | tail -n 10 \
        | tee -a "$out/extremes.md"
    [ "${PIPESTATUS[0]}" -eq 0 ] || extremes=1
    echo "extremes: exit $extremes in $((SECONDS - t0)) s" | tee -a "$out/extremes.md"
fi
if want models; then
    echo "== the ledger's bug models on cuda: K3N-014 on the built ops, K3N-008 on SGLang, the races' region rule"
    t0=$SECONDS
    python -m k3num.harness.cli build-ops --jobs "$(nproc)" > "$out/models-build.log" 2>&1 || models=1
    echo "build-ops exit $models in $((SECONDS - t0)) s" | tee -a "$out/models.log"
    for spec in "vllm|zero_or_nonfinite or K3N-014|properties/test_context_kv_ops.py" \
                "sglang|model_aggregation or K3N-008|properties/test_off_path_shapes.py" \
                "vllm,vllm-rocm|repeated_calls_are or written_in_the_call|properties/test_determinism.py properties/test_attn_res.py"; do
        IFS='|' read -r engines sel files <<< "$spec"
        # shellcheck disable=SC2086
        timeout -s INT "${K3NUM_MODELS_TIMEOUT:-200}" python -m pytest $files properties/test_ledger_reproducers.py \
            -k "$sel" --engine "$engines" --device cuda --hypothesis-profile=ci -q -rxXf -p no:cacheprovider \
            -n "${K3NUM_MODELS_WORKERS:-4}" > "$out/models-${engines//,/-}.log" 2>&1 || models=1
        echo "-- $engines ($sel)" | tee -a "$out/models.log"
        grep -E "^(XFAIL|FAILED|ERROR)|passed|failed" "$out/models-${engines//,/-}.log" | cut -c1-600 | tee -a "$out/models.log"
    done
    echo "models: exit $models in $((SECONDS - t0)) s" | tee -a "$out/models.log"
fi
if want race4; then
    echo "== K3N-004/005's write race: every distinct output of cases inside the rule, kept for the bug model"
    t0=$SECONDS
    timeout -s INT "${K3NUM_RACE4_TIMEOUT:-240}" python scripts/collect_write_race.py "$out/write-race.pt" \
        --calls "${K3NUM_RACE4_CALLS:-300}" > "$out/race4.log" 2>&1 || race4=1
    cut -c1-400 "$out/race4.log"
    echo "race4: exit $race4 in $((SECONDS - t0)) s" | tee -a "$out/race4.log"
fi
if want ledger; then
    echo "== every ledger entry's case class through the draft step on cuda (vLLM's ops built for K3N-014)"
    t0=$SECONDS
    python -m k3num.harness.cli build-ops --jobs "$(nproc)" > "$out/ledger.log" 2>&1 || ledger=1
    echo "build-ops exit $ledger in $((SECONDS - t0)) s" | tee -a "$out/ledger.log"
    t0=$SECONDS
    timeout -s INT "${K3NUM_LEDGER_TIMEOUT:-300}" python -m k3num.harness.cli impact --ledger --device cuda \
        --cases "${K3NUM_LEDGER_CASES:-10}" --format csv > "$out/impact-ledger-gpu.csv" 2>> "$out/ledger.log"
    rc=$?
    echo "impact --ledger (csv) exit $rc in $((SECONDS - t0)) s" | tee -a "$out/ledger.log"
    [ "$rc" -eq 0 ] || ledger=1
    python - "$out/impact-ledger-gpu.csv" <<'PY' | tee "$out/impact-ledger-gpu.md"
import sys
import pandas as pd
t = pd.read_csv(sys.argv[1], keep_default_na=False)
cols = [c for c in ("entry", "role", "engine", "drafter", "positions", "identical", "tie_break", "diverged", "agreement",
                    "noise_agreement", "worst_err_over_delta", "severity", "note") if c in t]
print(t[cols].to_string(index=False))
PY
fi
if want ranks; then
    echo "== PP stages as ranks on NCCL (one GPU per rank)"
    timeout -s INT "${K3NUM_RANKS_TIMEOUT:-300}" python -m pytest properties/test_pp_ranks.py --device cuda \
        -p no:cacheprovider -q -rs --drift-csv "$out/ranks.csv" 2>&1 | tail -n 20 | tee "$out/ranks.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || ranks=1
fi
if want known; then
    echo "== known races are known: the in-place prefix rewrite (K3N-007) under nightly-1k, unsharded and sharded"
    for mode in plain shards; do
        args=(); [ "$mode" = shards ] && args=(-n 4 --shards 4)
        t0=$(date +%s)
        timeout -s INT "${K3NUM_KNOWN_TIMEOUT:-200}" python -m pytest properties/test_determinism.py \
            -k in_place_prefix_rewrite --engine vllm,vllm-rocm --device cuda -p no:cacheprovider -q -rfxX \
            --hypothesis-profile=nightly-1k --drift-csv "$out/known-$mode.csv" "${args[@]}" 2>&1 \
            | grep -v "^SKIPPED" | tail -n 25 > "$out/known-$mode.log"
        rc=${PIPESTATUS[0]}
        echo "known ($mode): exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/known-$mode.log"
        grep -E "XFAIL|FAILED|passed|failed" "$out/known-$mode.log" | head -n 12
        [ "$rc" -eq 0 ] || known=1
    done
fi
if want oracle; then
    echo "== the float64 oracles at K3 shapes against the plain fp64 GEMM and the copy rate (bench/oracle_throughput.py)"
    python bench/oracle_throughput.py --tokens 1024,8192 --reps "${K3NUM_ORACLE_REPS:-20}" \
        --only "${K3NUM_ORACLE_ONLY:-precompute,attn_res}" --csv "$out/oracle.csv" \
        ${K3NUM_ORACLE_PROFILE:+--profile} 2> "$out/oracle-profile.txt" | tee "$out/oracle.md"
    [ "${PIPESTATUS[0]}" -eq 0 ] || oracle=1
    if [ -n "${K3NUM_ORACLE_BITS_ROOT:-}" ]; then  # the oracle's values against another tree's, on this GPU
        python scripts/oracle_bits.py save "$out/bits-before.pt" --device cuda --root "$K3NUM_ORACLE_BITS_ROOT" \
            && python scripts/oracle_bits.py save "$out/bits-after.pt" --device cuda \
            && python scripts/oracle_bits.py compare "$out/bits-before.pt" "$out/bits-after.pt" | tee -a "$out/oracle.md"
        [ "${PIPESTATUS[0]}" -eq 0 ] || oracle=1
        rm -f "$out"/bits-*.pt
    fi
fi
if want profile; then
    echo "== where a K3-shape property's time goes (bench/suite_profile.py --examples ${K3NUM_PROFILE_EXAMPLES:-100})"
    python bench/suite_profile.py --examples "${K3NUM_PROFILE_EXAMPLES:-100}" --csv "$out/suite-profile.csv" \
        2> "$out/suite-profile.err" | tee "$out/suite-profile.md"
    [ "${PIPESTATUS[0]}" -eq 0 ] || profile=1
fi
if want derand; then
    echo "== the K3-shape suite derandomized (${K3NUM_DERAND_PROFILE:-ci}), its drift CSV against K3NUM_DERAND_BEFORE"
    K3NUM_PROFILE=${K3NUM_DERAND_PROFILE:-ci} K3NUM_SUITE="properties -m gpu" K3NUM_ENGINES=$k3_engines \
        bash scripts/gpu_nightly.sh "$out/derand" > "$out/derand.log" 2>&1 || derand=1
    tail -n 3 "$out/derand.log"
    cp "$out/derand/drift.csv" "$out/derand.csv" 2>/dev/null
    if [ -n "${K3NUM_DERAND_BEFORE:-}" ]; then
        python scripts/csv_identity.py "$K3NUM_DERAND_BEFORE" "$out/derand.csv" --exclude-ledger | tee "$out/derand.txt"
        [ "${PIPESTATUS[0]}" -eq 0 ] || derand=1
    fi
fi
if want nightly; then
    echo "== the K3-shape suite under ${K3NUM_NIGHTLY_PROFILE:-nightly} (shards ${K3NUM_SHARDS:-1}, \
${K3NUM_WORKERS_PER_GPU:-4} workers per GPU, limit ${K3NUM_TIMEOUT}s)"
    # every GPU's utilisation (the share of each second a kernel ran), sampled each second while the suite runs
    nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits -l 1 > "$out/nightly-util.csv" &
    util_pid=$!
    K3NUM_PROFILE=${K3NUM_NIGHTLY_PROFILE:-nightly} K3NUM_SUITE="properties -m gpu" K3NUM_ENGINES=$k3_engines \
        bash scripts/gpu_nightly.sh "$out/nightly" --hypothesis-show-statistics > "$out/nightly.log" 2>&1 || nightly=1
    kill "$util_pid" 2>/dev/null
    tail -n 3 "$out/nightly.log"
    python scripts/nightly_rates.py "$out/nightly" | tee "$out/nightly.md"
    [ "${PIPESTATUS[0]}" -eq 0 ] || nightly=1
    python - "$out/nightly-util.csv" <<'PY' | tee -a "$out/nightly.md"
import sys
import pandas as pd
u = pd.read_csv(sys.argv[1], header=None, names=["gpu", "util"])
for g, s in u.groupby("gpu"):
    print(f"GPU {g} utilisation over {len(s)} s: mean {s.util.mean():.0f}%, median {s.util.median():.0f}%, "
          f"seconds at >= 90%: {(s.util >= 90).mean():.0%}")
PY
    grep -E "passed|failed|ERROR" "$out/nightly/pytest.log" | tail -n 5
fi
if want ts; then
    echo "== TokenSpeed on cuda: tokenspeed-kernel's Triton kernels natively, rope.so where it loads, the AttnRes stack"
    tag=$(python -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
    python -c "import tvm_ffi" 2>/dev/null || python -m pip install -q --no-deps \
        "$K3NUM_ENGINE_CACHE"/runtime-wheels/apache_tvm_ffi-*-"$tag"-*.whl 2>&1 | grep -v "WARNING: Running pip as" | tail -n 2
    python -c "import tvm_ffi; print('tvm_ffi', tvm_ffi.__version__)" 2>&1 | tail -n 1 | tee "$out/ts-tvm.txt"
    python -c "from k3num.engines import registry; e = registry.get('tokenspeed'); print(e.mode, '|', e.real_ops, '|', e.mode_note)" \
        | tee "$out/ts-engine.txt"
    t0=$(date +%s)
    timeout -s INT "${K3NUM_TS_SMALL_TIMEOUT:-200}" python -m pytest properties --engine tokenspeed --ignore=properties/test_k3_shapes.py \
        -p no:cacheprovider -q --hypothesis-profile="${K3NUM_TS_SMALL_PROFILE:-ci}" --drift-csv "$out/ts-small.csv" \
        --durations=8 -n 4 2>&1 | grep -v "^SKIPPED" | tail -n 30 | tee "$out/ts-small.log"
    rc=${PIPESTATUS[0]}; echo "ts small [${K3NUM_TS_SMALL_PROFILE:-ci}]: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/ts.txt"
    [ "$rc" -eq 0 ] || ts=1
    t0=$(date +%s)
    [ "${K3NUM_TS_K3_PROFILE:-nightly-1k}" = none ] || timeout -s INT "${K3NUM_TS_K3_TIMEOUT:-260}" python -m pytest properties/test_k3_shapes.py --engine tokenspeed \
        -p no:cacheprovider -q --hypothesis-profile="${K3NUM_TS_K3_PROFILE:-nightly-1k}" --drift-csv "$out/ts-k3.csv" \
        --durations=8 -n 4 --dist worksteal 2>&1 | grep -v "^SKIPPED" | tail -n 30 | tee "$out/ts-k3.log"
    rc=${PIPESTATUS[0]}; echo "ts k3 [${K3NUM_TS_K3_PROFILE:-nightly-1k}]: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/ts.txt"
    [ "$rc" -eq 0 ] || ts=1
fi
if want check; then
    echo "== k3num check on cuda: the pinned bytes against themselves, then a planted bug"
    python - "$out/check-trees" <<'PY'
import sys
from pathlib import Path
from k3num.harness import fixes
root = Path(sys.argv[1])
fixes.pinned_tree("vllm", root / "pinned")
fixes.patched_tree(fixes.by_id("mixture-scaled"), root / "bug")
PY
    for e in ${K3NUM_CHECK_ENGINES:-vllm vllm-rocm}; do
        timeout -s INT "${K3NUM_CHECK_TIMEOUT:-200}" python -m k3num.harness.cli check --engine "$e" \
            --head "$out/check-trees/pinned" -k attn_res --device cuda --out "$out/check-$e-pinned" \
            > "$out/check-$e-pinned.log" 2>&1
        echo "check $e pinned: exit $? (want 0)" | tee -a "$out/check.txt"
        tail -n 2 "$out/check-$e-pinned.log" | tee -a "$out/check.txt"
        cat "$out/check-$e-pinned/check.md" >> "$out/check.txt" 2>/dev/null
    done
    timeout -s INT "${K3NUM_CHECK_TIMEOUT:-200}" python -m k3num.harness.cli check --engine vllm \
        --head "$out/check-trees/bug" -k attn_res_within --device cuda --out "$out/check-vllm-bug" \
        > "$out/check-vllm-bug.log" 2>&1
    rc=$?; echo "check vllm mixture-scaled: exit $rc (want 1)" | tee -a "$out/check.txt"
    [ "$rc" -eq 1 ] || check=1
    cat "$out/check-vllm-bug/check.md" >> "$out/check.txt" 2>/dev/null
    grep -q "exit 0 (want 0)" "$out/check.txt" || check=1
    [ "$(grep -c 'pinned: exit 0 (want 0)' "$out/check.txt")" -eq "$(echo ${K3NUM_CHECK_ENGINES:-vllm vllm-rocm} | wc -w)" ] || check=1
    python bench/check_speed.py --engines vllm -k "${K3NUM_CHECK_BENCH_K:-attn_res}" 2>/dev/null | tee -a "$out/check.txt"
    rm -rf "$out/check-trees" "$out"/check-*/repro
fi
if want checkops; then
    echo "== k3num check on vLLM's built ops: the pinned csrc, a checkout's rebuilt csrc, a bug planted in it"
    [ -f "$K3NUM_ENGINE_CACHE/vllm-0.33.0-csrc/MANIFEST.json" ] || { echo "missing $K3NUM_ENGINE_CACHE/vllm-0.33.0-csrc (carry it)"; exit 2; }
    trees=/tmp/k3num-checkops; rm -rf "$trees"; mkdir -p "$trees"
    python -c "import sys; from pathlib import Path; from k3num.harness import fixes; fixes.pinned_tree('vllm', Path(sys.argv[1]))" "$trees/pinned"
    cp -r "$trees/pinned" "$trees/checkout"; cp -r "$K3NUM_ENGINE_CACHE/vllm-0.33.0-csrc/csrc" "$trees/checkout/csrc"
    echo "// a head's edit (k3num device_session checkops)" >> "$trees/checkout/csrc/cache_kernels.cu"
    cp -r "$trees/checkout" "$trees/bug"
    # the planted bug: the grouped insert writes pe_dim - 1 elements of k_pe, not pe_dim
    sed -i 's/copy(k_pe_layer, k_pe_token_stride, pe_dim, kv_lora_rank);/copy(k_pe_layer, k_pe_token_stride, pe_dim - 1, kv_lora_rank);/' \
        "$trees/bug/csrc/cache_kernels.cu"
    grep -q "pe_dim - 1, kv_lora_rank" "$trees/bug/csrc/cache_kernels.cu" || { echo "checkops: the plant did not apply"; checkops=1; }
    sel=${K3NUM_CHECKOPS_K:-context_kv and not k3_shapes}
    timed() {  # label, command...: run, log, and append "label | exit | seconds" to the table
        local label=$1; shift; local t0; t0=$(date +%s)
        timeout -s INT "${K3NUM_CHECKOPS_TIMEOUT:-150}" "$@" > "$out/checkops-$label.log" 2>&1
        local rc=$?; echo "| $label | $rc | $(( $(date +%s) - t0 )) |" >> "$out/checkops.md"; tail -n 3 "$out/checkops-$label.log"
        return $rc
    }
    printf '| step | exit | s |\n| --- | --- | --- |\n' > "$out/checkops.md"
    timed build-pinned python -m k3num.harness.cli build-ops --jobs "$(nproc)"
    timed check-pinned python -m k3num.harness.cli check --engine vllm --head "$trees/pinned" -k "$sel" --device cuda \
        --out "$out/checkops-pinned"; [ $? -eq 0 ] || checkops=1
    timed build-checkout python -m k3num.harness.cli build-ops --jobs "$(nproc)" --engine-src "vllm=$trees/checkout"
    timed check-checkout python -m k3num.harness.cli check --engine vllm --head "$trees/checkout" -k "$sel" --device cuda \
        --out "$out/checkops-checkout"; [ $? -eq 0 ] || checkops=1
    timed build-bug python -m k3num.harness.cli build-ops --jobs "$(nproc)" --engine-src "vllm=$trees/bug"
    timed check-bug python -m k3num.harness.cli check --engine vllm --head "$trees/bug" -k "$sel" --device cuda \
        --out "$out/checkops-bug"; [ $? -eq 1 ] || checkops=1
    for d in pinned checkout bug; do
        { echo; echo "### check-$d"; sed -n '1,12p' "$out/checkops-$d/check.md" 2>/dev/null; } >> "$out/checkops.md"
        rm -rf "$out/checkops-$d/repro" "$out/checkops-$d/side-head/cases.pt"
    done
    cat "$out/checkops.md"
fi
if want stores; then
    echo "== bf16 stores of the pinned Triton kernels on stored inputs"
    python -m k3num.harness.store_golden capture "$out/bf16_stores_h200.safetensors" 2>&1 | tail -n 5
    stores=${PIPESTATUS[0]}
fi
if want isolation; then
    echo "== isolation: one planted kernel bug on the GPU"
    # a plant NAME@xdist runs under pytest-xdist with 2 workers (a lost context: the worker is replaced)
    for spec in ${K3NUM_ISOLATION_PLANTS:-none combine-scaled combine-illegal-address combine-illegal-address@xdist}; do
        plant=${spec%@xdist} tag=${spec/@/-} extra=()
        [ "$plant" != "$spec" ] && extra=(-- -n 2 --dist load --max-worker-restart 100)
        python scripts/gpu_isolation.py --plant "$plant" --out "$out/isolation-$tag" \
            --profile "${K3NUM_ISOLATION_PROFILE:-ci}" --timeout "${K3NUM_ISOLATION_TIMEOUT:-240}" \
            --peak-bound-gib "${K3NUM_ISOLATION_PEAK_GIB:-0}" ${K3NUM_ISOLATION_ARGS:-} "${extra[@]}" || isolation=1
        cp "$out/isolation-$tag/isolation.md" "$out/isolation-$tag.md" 2>/dev/null
        cp "$out/isolation-$tag/isolation.csv" "$out/isolation-$tag.csv" 2>/dev/null
        rm -rf "$out/isolation-$tag/tree"
    done
fi
if want golden; then
    echo "== golden set against the live oracle at K3 shapes"
    python bench/golden_speed.py --device cuda --cases "${K3NUM_GOLDEN_CASES:-4}" --csv "$out/golden.csv" \
        | tee "$out/golden.md"
    golden=${PIPESTATUS[0]}
fi
if want k3det; then
    echo "== K3-shape determinism [${K3NUM_K3DET_PROFILE:-nightly-1k}]"
    t0=$(date +%s)
    timeout -s INT "${K3NUM_K3DET_TIMEOUT:-540}" python -m pytest properties/test_k3_shapes.py -k repeated_calls \
        --engine vllm,vllm-rocm -n "${K3NUM_K3DET_WORKERS:-4}" --dist worksteal -p no:cacheprovider -q \
        --hypothesis-profile="${K3NUM_K3DET_PROFILE:-nightly-1k}" --drift-csv "$out/k3det.csv" --durations=5 \
        2>&1 | grep -v "^SKIPPED" | tail -n 30 | tee "$out/k3det.log"
    k3det=${PIPESTATUS[0]}
    echo "k3det: exit $k3det in $(( $(date +%s) - t0 )) s" | tee -a "$out/k3det.log"
fi
if want scale; then
    echo "== scale-out: the K3-shape properties [$k3_profile] per worker count"
    echo "| how | workers | exit | wall s | records |" > "$out/scale.md"
    echo "| --- | --- | --- | --- | --- |" >> "$out/scale.md"
    if [ -n "${K3NUM_SCALE_BASELINE:-}" ]; then
        t0=$(date +%s)
        K3NUM_PROFILE=$k3_profile K3NUM_SUITE="properties -m gpu" \
            K3NUM_ENGINES="${K3NUM_SCALE_BASELINE_JOBS:-vllm vllm-rocm sglang@mix sglang@draft tokenspeed}" \
            K3NUM_ENGINE_TIMEOUT=$K3NUM_TIMEOUT bash "$K3NUM_SCALE_BASELINE" "$out/scale-baseline" > "$out/scale-baseline.log" 2>&1
        rc=$?
        echo "| $(basename "$K3NUM_SCALE_BASELINE") (one process per job) | - | $rc | $(( $(date +%s) - t0 )) |" \
             "$(python -c "import pandas as pd; print(len(pd.read_csv('$out/scale-baseline/drift.csv')))" 2>/dev/null) |" >> "$out/scale.md"
        [ "$rc" -eq 0 ] || scale=1
    fi
    for n in ${K3NUM_SCALE_WORKERS:-1 4 8}; do
        t0=$(date +%s)
        K3NUM_PROFILE=$k3_profile K3NUM_SUITE="properties -m gpu" K3NUM_ENGINES=$k3_engines K3NUM_WORKERS=$n \
            bash scripts/gpu_nightly.sh "$out/scale-$n" ${K3NUM_SCALE_K:+-k "$K3NUM_SCALE_K"} > "$out/scale-$n.log" 2>&1
        rc=$?
        echo "| gpu_nightly.sh (xdist) | $n | $rc | $(( $(date +%s) - t0 )) |" \
             "$(python -c "import pandas as pd; print(len(pd.read_csv('$out/scale-$n/drift.csv')))" 2>/dev/null) |" >> "$out/scale.md"
        [ "$rc" -eq 0 ] || scale=1
    done
    cat "$out/scale.md"
fi
if want hunt; then
    echo "== the hunt: determinism, poisoned memory, off-path shapes (cuda)"
    t0=$(date +%s)
    timeout -s INT "${K3NUM_HUNT_TIMEOUT:-300}" python -m pytest properties/test_determinism.py \
        properties/test_poisoned_memory.py properties/test_off_path_shapes.py --engine vllm,vllm-rocm,sglang,tokenspeed \
        -p no:cacheprovider -q -rfEX --hypothesis-profile="${K3NUM_HUNT_PROFILE:-ci}" --drift-csv "$out/hunt.csv" \
        --durations=10 2>&1 | grep -v "^SKIPPED" | tail -n 60 | tee "$out/hunt.log"
    hunt=${PIPESTATUS[0]}
    echo "hunt properties: exit $hunt in $(( $(date +%s) - t0 )) s" | tee -a "$out/hunt.log"
    echo "== flaky-race reproducer (K3N-007 mechanism, lead 2)"
    python scripts/repro_attn_res_flaky.py --calls "${K3NUM_FLAKY_CALLS:-300}" --csv "$out/attn_res_flaky.csv" \
        | tee "$out/attn_res_flaky.md" || hunt=1
    echo "== the ledger's fixes on patched copies"
    python scripts/prove_fixes.py --out "$out/fixes" --profile "${K3NUM_HUNT_PROFILE:-ci}" || hunt=1
fi
if want sanitize; then
    echo "== compute-sanitizer over the kernel subjects"
    PATH=$PATH:/usr/local/cuda/bin python scripts/gpu_sanitize.py --out "$out/sanitize" \
        --timeout "${K3NUM_SANITIZE_TIMEOUT:-200}"
    sanitize=$?
fi
if want csrc; then
    echo "== build-ops from a checkout's csrc (the pinned files laid out as a vLLM checkout, one kernel edited)"
    [ -f "$K3NUM_ENGINE_CACHE/vllm-0.33.0-csrc/MANIFEST.json" ] || { echo "missing $K3NUM_ENGINE_CACHE/vllm-0.33.0-csrc (carry it)"; exit 2; }
    tree=/tmp/k3num-vllm-checkout; rm -rf "$tree"; mkdir -p "$tree"
    cp -r "$K3NUM_ENGINE_CACHE/vllm-0.33.0-csrc/csrc" "$tree/csrc"
    cp -r "$K3NUM_ENGINE_CACHE/vllm-0.33.0/vllm" "$tree/vllm"
    echo "// a head's edit (k3num device_session csrc)" >> "$tree/csrc/cache_kernels.cu"
    t0=$(date +%s)
    python -m k3num.harness.cli build-ops --jobs "$(nproc)" 2>&1 | tail -n 3 | tee "$out/csrc_pinned.log"
    t1=$(date +%s)
    python -m k3num.harness.cli build-ops --jobs "$(nproc)" --engine-src "vllm=$tree" 2>&1 | tail -n 3 | tee "$out/csrc_head.log"
    csrc=${PIPESTATUS[0]}
    t2=$(date +%s)
    echo "build-ops: pinned $((t1 - t0)) s, checkout $((t2 - t1)) s (exit $csrc)" | tee -a "$out/csrc_head.log"
    if [ "$csrc" -eq 0 ]; then
        timeout -s INT "${K3NUM_CSRC_TIMEOUT:-150}" python -m pytest properties/test_context_kv_ops.py properties/test_context_kv.py \
            --engine vllm --engine-src "vllm=$tree" -p no:cacheprovider -q --hypothesis-profile=ci \
            --drift-csv "$out/csrc_head.csv" 2>&1 | tail -n 30 | tee -a "$out/csrc_head.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || csrc=1
    fi
fi
if want ops; then
    # vLLM's compiled ops of each release in K3NUM_OPS_RELEASES (default: the default release, 0.34.0, then 0.33.0),
    # each built from its own pinned csrc (carry engine-cache/vllm-RELEASE-csrc): the build, the fused path's speed
    # (the default release only), the context-KV properties at small shapes and K3 shapes, one pytest per release
    # (one process registers one library of these op names)
    echo "== vLLM's CUDA ops: build, speed, properties (releases: ${K3NUM_OPS_RELEASES:-0.34.0 0.33.0})"
    for rel in ${K3NUM_OPS_RELEASES:-0.34.0 0.33.0}; do
        [ -f "$K3NUM_ENGINE_CACHE/vllm-$rel-csrc/MANIFEST.json" ] || { echo "missing $K3NUM_ENGINE_CACHE/vllm-$rel-csrc (carry it)"; ops=1; continue; }
        [ -f "$K3NUM_ENGINE_CACHE/vllm-$rel/MANIFEST.json" ] || { echo "missing $K3NUM_ENGINE_CACHE/vllm-$rel (carry it)"; ops=1; continue; }
        spec="vllm@$rel"
        t0=$(date +%s)
        python -m k3num.harness.cli build-ops --jobs "$(nproc)" --engine-src "vllm=$K3NUM_ENGINE_CACHE/vllm-$rel" 2>&1 \
            | tee "$out/build_ops-$rel.log"
        rc=${PIPESTATUS[0]}
        echo "build-ops $spec: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/build_ops-$rel.log"
        if [ "$rc" -ne 0 ]; then ops=1; continue; fi
        if [ -z "${speed_done:-}" ]; then  # the first release's build (the speed table is of one library)
            speed_done=1
            python bench/context_kv_speed.py --reps "${K3NUM_BENCH_REPS:-20}" --csv "$out/context_kv_speed.csv" \
                | tee "$out/context_kv_speed.md" || ops=1
        fi
        ckv="properties/test_context_kv.py properties/test_context_kv_ops.py properties/test_mla_epilogue.py"
        ckv="$ckv properties/test_ledger_reproducers.py"
        timeout -s INT "${K3NUM_OPS_SMALL_TIMEOUT:-150}" python -m pytest $ckv --engine "$spec" -p no:cacheprovider -q \
            -rfEsx --hypothesis-profile="${K3NUM_OPS_SMALL_PROFILE:-ci}" --drift-csv "$out/ops_small-$rel.csv" 2>&1 \
            | grep -E "^(FAILED|ERROR|XFAIL|XPASS)|passed|failed|source-gpu" | cut -c1-300 | tee "$out/ops_small-$rel.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || ops=1
        if [ "${K3NUM_OPS_K3_PROFILE:-nightly-1k}" != none ]; then
            timeout -s INT "${K3NUM_OPS_K3_TIMEOUT:-240}" python -m pytest properties/test_k3_shapes.py --engine "$spec" \
                -k "context_kv or cache_slot or row_block" -p no:cacheprovider -q \
                --hypothesis-profile="${K3NUM_OPS_K3_PROFILE:-nightly-1k}" --drift-csv "$out/ops_k3-$rel.csv" \
                --hypothesis-show-statistics 2>&1 | grep -E "passing examples|Stopped because|passed|failed|error|ERROR|k3-numerics|source-gpu|vllm " \
                | tee "$out/ops_k3-$rel.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || ops=1
        fi
    done
fi
if want bench; then
    echo "== engine kernel bandwidth"
    python bench/engine_kernels.py --reps "${K3NUM_BENCH_REPS:-20}" --csv "$out/engine_kernels.csv" | tee "$out/engine_kernels.md"
    bench=${PIPESTATUS[0]}
fi
if want race; then
    echo "== K3N-004/005 reproducer (attn_res write race)"
    python scripts/repro_attn_res_write_race.py --calls 200 --csv "$out/attn_res_write_race.csv" | tee "$out/attn_res_write_race.md"
    race=${PIPESTATUS[0]}
fi
k3_pid= small_pid=
if want k3; then
    echo "== properties at K3 shapes [$k3_profile: $k3_engines]"
    K3NUM_PROFILE=$k3_profile K3NUM_SUITE="properties -m gpu" K3NUM_ENGINES=$k3_engines \
        bash scripts/gpu_nightly.sh "$out/k3" > "$out/k3.log" 2>&1 &
    k3_pid=$!
fi
if want small; then
    echo "== properties at small shapes on cuda [$small_profile: $small_engines]"
    K3NUM_PROFILE=$small_profile K3NUM_SUITE="properties --ignore=properties/test_k3_shapes.py" \
        K3NUM_ENGINES=$small_engines bash scripts/gpu_nightly.sh "$out/small" > "$out/small.log" 2>&1 &
    small_pid=$!
fi
if [ -n "$k3_pid" ]; then wait "$k3_pid"; k3=$?; cat "$out/k3.log"; fi
if [ -n "$small_pid" ]; then wait "$small_pid"; small=$?; cat "$out/small.log"; fi
dirs=(); for d in k3 small; do [ -d "$out/$d" ] && dirs+=("$d"); done
[ ${#dirs[@]} -gt 0 ] && tar czf "$out/properties.tgz" -C "$out" "${dirs[@]}"
echo "device_session: mutate exit $mutate, extremes exit $extremes, models exit $models, race4 exit $race4, stream exit $stream, tpgemm exit $tpgemm, around exit $around, contract exit $contract, race7 exit $race7, release exit $release, ledger exit $ledger, tokens exit $tokens, ranks exit $ranks, known exit $known, nightly exit $nightly, oracle exit $oracle, profile exit $profile, derand exit $derand, ts exit $ts, checkops exit $checkops, check exit $check, csrc exit $csrc, stores exit $stores, isolation exit $isolation, golden exit $golden, k3det exit $k3det, scale exit $scale, hunt exit $hunt, sanitize exit $sanitize, ops exit $ops, bench exit $bench, race reproducer exit $race, K3 properties exit $k3, small properties exit $small"
[ "$mutate" -eq 0 ] && [ "$extremes" -eq 0 ] && [ "$models" -eq 0 ] && [ "$race4" -eq 0 ] && [ "$markov" -eq 0 ] && [ "$epilogue" -eq 0 ] && [ "$stream" -eq 0 ] && [ "$tpgemm" -eq 0 ] && [ "$around" -eq 0 ] && [ "$contract" -eq 0 ] && [ "$race7" -eq 0 ] && [ "$release" -eq 0 ] && [ "$ledger" -eq 0 ] && [ "$tokens" -eq 0 ] && [ "$ranks" -eq 0 ] && [ "$known" -eq 0 ] && [ "$nightly" -eq 0 ] && [ "$oracle" -eq 0 ] && [ "$profile" -eq 0 ] && [ "$derand" -eq 0 ] && [ "$ts" -eq 0 ] && [ "$checkops" -eq 0 ] && [ "$check" -eq 0 ] && [ "$csrc" -eq 0 ] && [ "$stores" -eq 0 ] && [ "$isolation" -eq 0 ] && [ "$golden" -eq 0 ] && [ "$k3det" -eq 0 ] && [ "$scale" -eq 0 ] && [ "$hunt" -eq 0 ] && [ "$sanitize" -eq 0 ] && [ "$ops" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$race" -eq 0 ] && [ "$k3" -eq 0 ] && [ "$small" -eq 0 ]
