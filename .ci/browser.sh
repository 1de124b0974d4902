#!/usr/bin/env bash
# The browser test (tests/browser): the notebooks run in JupyterLab inside Debian's headless Chromium, driven by
# Python playwright. .ci/run calls this after the main tests, inside its virtual environment (activated here if not).
# It installs what is missing: Chromium from Debian (playwright's own browser download cannot work offline and is not
# used), playwright from PyPI. Where either cannot be installed, the test skips and says why; it never fails for lack
# of a browser. Screenshots and a JSON report per notebook land in $K2LAB_ARTIFACTS (default tests/browser/artifacts).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv-ci/bin/activate ]; then
  source .venv-ci/bin/activate
fi

if [ ! -x /usr/bin/chromium ] && [ -z "${K2LAB_CHROMIUM:-}" ] && command -v apt-get >/dev/null; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  echo "browser.sh: installing Debian's chromium (about a minute)"
  if ! { timeout 300 $sudo apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive timeout 600 $sudo apt-get install -y -qq --no-install-recommends \
           chromium fonts-liberation fonts-dejavu-core >/dev/null; }; then
    echo "browser.sh: could not install chromium; the browser test will skip"
  fi
fi

if ! python -c "import playwright.sync_api" 2>/dev/null; then
  timeout 300 python -m pip install -q "playwright>=1.40" ||
    echo "browser.sh: could not install playwright; the browser test will skip"
fi

export HF_HUB_OFFLINE=1
python -m pytest -q -m browser tests/browser
