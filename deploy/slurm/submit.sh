#!/bin/bash
# Submits the run and its finalize step: the array first, then finalize, which Slurm starts
# only once every array task has ended with exit 0 (afterok). Run it from the folder holding
# spool.toml; SPOOL, SPOOL_CONFIG, SPOOL_MODEL and SPOOL_DATA_DIR are passed through.
#   bash deploy/slurm/submit.sh
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)

# --parsable prints "<jobid>" or "<jobid>;<cluster>".
array=$(sbatch --parsable "$here/spool-array.sbatch")
array=${array%%;*}
finalize=$(sbatch --parsable --dependency="afterok:${array}" --kill-on-invalid-dep=yes \
    "$here/spool-finalize.sbatch")
finalize=${finalize%%;*}

echo "array job ${array} (spool run, one task per partition)"
echo "finalize job ${finalize} (spool finalize, after every task of ${array} succeeded)"
echo "watch: squeue -j ${array},${finalize}"
