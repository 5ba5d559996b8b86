# Shared by the GPU scripts (source it from the repository root): the settings every run takes from the
# environment, what the device machine lacks (packages from a carried wheel folder; mmspec itself, whose families are
# found through its entry points, installed from the checkout), one log, time-limited bench runs into a work folder
# and one archive of their summaries.
#   DEVICE (cuda) DTYPE (bfloat16) PYTHON (python3) OUT (the caller's default) LIMIT (the caller's default)
# The device machine lacks diffusers and the t2i caption cleaning's ftfy and beautifulsoup4: carry a folder `.wheels`
# (git ignores it; the device call names it in `carry`) holding their wheels and those of the packages they need there:
#   pip download --no-deps --only-binary=:all: diffusers ftfy wcwidth beautifulsoup4 soupsieve -d .wheels
# The embedded models exceed what a device call sends: scripts/device_slim.sh says how to carry only those needed.
DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}; PY=${PYTHON:-python3}; WORK=$(mktemp -d)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
SITE=$WORK/site  # what the device machine lacks: the carried wheels, and mmspec's entry points (its families)
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
MISSING=$($PY -c "import importlib.util as u; print(*(m for m in ('diffusers', 'ftfy', 'bs4') if not u.find_spec(m)))")
[ -z "$MISSING" ] || $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl
$PY -c "from importlib.metadata import entry_points as e; assert e(group='mmspec.families')" 2>/dev/null ||
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . >/dev/null 2>&1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt"; }
timed() {  # NAME LIMIT COMMAND...: COMMAND's output into the log, cut at LIMIT seconds; its start (with the load)
  local name=$1 limit=$2; shift 2  # and its exit status logged
  log "start $name ($(uptime | sed 's/.*load/load/'))"
  timeout "$limit" "$@" >>"$OUT/log.txt" 2>&1
  log "end $name (exit $?)"
}
family_bench() {  # FAMILY NAME LIMIT ARGS...: one bench into $WORK/NAME, cut at LIMIT seconds (each batch size's
  local family=$1 name=$2 limit=$3; shift 3  # figures are written when it completes, so a cut run keeps them)
  timed "$name" "$limit" $PY -m mmspec bench --family "$family" --seed 0 --device "$DEVICE" --no-plots --quiet \
    --out "$WORK/$name" "$@"
}
machine_header() {  # the GPU, driver, torch and transformers into the log
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$OUT/log.txt" 2>&1
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    >>"$OUT/log.txt" 2>&1
}
archive_summaries() {  # every bench's summary files, as one archive in $OUT
  (cd "$WORK" && find . -name 'summary.*' | tar czf "$OUT/summaries.tar.gz" -T -)
  log "wrote $OUT/summaries.tar.gz"
}
