#!/bin/bash
# Runs the job, then its finalize step, without waiting forever on a failed index:
#   bash deploy/kubernetes/run.sh
# Applies the run (kustomization.yaml), waits until job/spool is Complete or Failed
# (an index that failed for good fails the Job: waiting for Complete alone would wait out
# the whole timeout), then applies finalize-job.yaml and waits for it the same way. On a
# failed run it names the failed indexes and stops; SPOOL_PARTIAL=1 then publishes what
# the others committed (`spool finalize --partial`). SPOOL_WAIT is the longest wait (48h).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
timeout=${SPOOL_WAIT:-48h}

# Waits for job $1 to be Complete or Failed; prints which.
finished() {
    local job=$1 complete failed outcome
    kubectl wait --for=condition=complete "job/$job" --timeout="$timeout" >/dev/null 2>&1 &
    complete=$!
    kubectl wait --for=condition=failed "job/$job" --timeout="$timeout" >/dev/null 2>&1 &
    failed=$!
    wait -n "$complete" "$failed" || true
    kill "$complete" "$failed" 2>/dev/null || true
    wait "$complete" "$failed" 2>/dev/null || true
    outcome=$(kubectl get "job/$job" -o jsonpath='{.status.conditions[?(@.status=="True")].type}')
    case " $outcome " in
        *" Complete "*) echo complete ;;
        *" Failed "*) echo failed ;;
        *) echo "timeout" ;;
    esac
}

kubectl apply -k "$here"
run=$(finished spool)
partial=()
if [ "$run" != complete ]; then
    failed=$(kubectl get job/spool -o jsonpath='{.status.failedIndexes}')
    echo "run.sh: job/spool is ${run} (failed indexes: ${failed:-none})" >&2
    if [ -z "${SPOOL_PARTIAL:-}" ]; then
        echo "run.sh: fix and rerun those partitions, or SPOOL_PARTIAL=1 to publish the rest" >&2
        exit 1
    fi
    partial=(--partial)
fi
if [ ${#partial[@]} -eq 0 ]; then
    kubectl apply -f "$here/finalize-job.yaml"
else
    # The same Job with --partial after `finalize`.
    sed 's/args: \["finalize", /args: ["finalize", "--partial", /' "$here/finalize-job.yaml" | kubectl apply -f -
fi
fin=$(finished spool-finalize)
echo "run.sh: job/spool-finalize is ${fin}"
[ "$fin" = complete ]
