#!/usr/bin/env bash
# Fetch Mermaid's browser bundle (pinned) from the npm registry into a folder and print the path of mermaid.min.js, for
# the site to draw the notebooks' diagrams with, offline:
#
#     export K2LAB_MERMAID_JS=$(bash scripts/site/fetch_mermaid.sh ~/.cache/k2lab-mermaid) && mkdocs build
#
# Without it the site shows each diagram's source instead. Needs npm; prints nothing and exits 1 when it cannot fetch.
set -euo pipefail
version=11.17.2
dest=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/k2lab-mermaid}
bundle="$dest/mermaid-$version/dist/mermaid.min.js"
if [ ! -s "$bundle" ]; then
  command -v npm >/dev/null || { echo "fetch_mermaid.sh: npm is not installed" >&2; exit 1; }
  mkdir -p "$dest"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && timeout 180 npm pack --silent "mermaid@$version" >/dev/null)  # npm checks the tarball's integrity
  mkdir -p "$dest/mermaid-$version"
  tar -xzf "$work/mermaid-$version.tgz" -C "$dest/mermaid-$version" --strip-components=1 \
    package/dist/mermaid.min.js package/LICENSE
fi
echo "$bundle"
