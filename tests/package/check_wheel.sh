#!/usr/bin/env bash
# `make package-check` (CI): numaudit installed the ordinary way, outside the checkout.
#
#   1. `python -m build` makes the sdist, then the wheel from the sdist (so the sdist holds all
#      the wheel needs: the kernel's sources and setup.py).
#   2. A fresh virtual environment in a scratch directory: torch (the pinned CPU wheel), then the
#      wheel, nothing else of the checkout.
#   3. From that scratch directory: `import numaudit` loads the fused CPU digest kernel built into
#      the wheel, with no warning; no generic top-level package (agents, auditor, wire, protos)
#      is installed; a 2-rank torchrun job streams to `auditor serve` twice and `auditor
#      compare` exits 0 on the clean pair.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
WORK="$(mktemp -d /tmp/numaudit-wheel.XXXXXX)"
trap 'kill "${SERVER:-}" 2>/dev/null || true; rm -rf "$WORK"' EXIT
say() { echo "[package-check] $*"; }

say "building the sdist and the wheel into $WORK/dist"
"$PY" -m build --outdir "$WORK/dist" "$REPO" > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
grep -q "numaudit: built .*libnumaudit_digest.so" "$WORK/build.log" || { say "the wheel build did not build the kernel:"; grep -i "numaudit" "$WORK/build.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/numaudit-*.whl)"
say "wheel: $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB); sdist: $(basename "$(ls "$WORK"/dist/numaudit-*.tar.gz)")"

say "a fresh virtual environment: torch==2.13.0, then the wheel"
python3 -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
pipi() { "$VPY" -m pip install -q "$@" >> "$WORK/pip.log" 2>&1 || { tail -30 "$WORK/pip.log"; exit 1; }; }
pipi --upgrade pip
pipi torch==2.13.0
pipi "$WHEEL"

cp "$REPO/tests/package/smoke_job.py" "$WORK/"
cd "$WORK"
say "the kernel loads, the names do not collide"
"$VPY" - <<'PY'
import importlib.util, logging, sys
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger().addHandler(Keep(level=logging.WARNING))
import numaudit
from numaudit.agents.kernels import cpu
assert cpu.load() is not None, cpu.load_error()
assert not warnings, warnings
assert "site-packages" in numaudit.__file__, numaudit.__file__
taken = [n for n in ("agents", "auditor", "wire", "protos") if importlib.util.find_spec(n)]
assert not taken, f"generic top-level packages installed: {taken}"
print(f"fused kernel: {cpu.__file__.rsplit('/', 1)[0]}/build, ISA level {cpu.load().numaudit_digest_isa()}")
PY

say "auditor serve, a 2-rank job twice, auditor compare"
"$WORK/venv/bin/auditor" serve --listen 127.0.0.1:0 --db "$WORK/audit.db" > "$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q "listening on" "$WORK/serve.log" && break; sleep 0.2; done
ADDR="$(grep -o "listening on [0-9.:]*" "$WORK/serve.log" | head -1 | awk '{print $3}')"
[ -n "$ADDR" ] || { cat "$WORK/serve.log"; exit 1; }
for run in ref cand; do
  NUMAUDIT_ADDR="$ADDR" NUMAUDIT_RUN="$run" "$VPY" -m torch.distributed.run --standalone \
    --nproc-per-node 2 smoke_job.py > "$WORK/$run.log" 2>&1 || { tail -30 "$WORK/$run.log"; exit 1; }
  if grep -q "fused CPU digest unavailable" "$WORK/$run.log"; then grep "fused" "$WORK/$run.log"; exit 1; fi
done
"$WORK/venv/bin/auditor" compare ref cand --db "$WORK/audit.db" > "$WORK/compare.txt" || { cat "$WORK/compare.txt"; exit 1; }
grep -m1 -E "identical|within policy" "$WORK/compare.txt"
say "ok"
