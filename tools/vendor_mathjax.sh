#!/usr/bin/env bash
# Vendor MathJax 3 so the book renders math with no network.
#
# npm installs the pinned mathjax package into _vendor/npm/ (gitignored); the subset the site needs
# (the tex-chtml component, its CHTML woff-v2 fonts, the TeX extensions that autoload pulls in on
# demand, the menu/accessibility modules) is copied to _vendor/static/mathjax/. _config.yml lists
# _vendor/static in html_static_path and sets mathjax_path: mathjax/tex-chtml.js, which Sphinx
# resolves against _static/, so every page loads _static/mathjax/tex-chtml.js from the site itself
# and MathJax finds its fonts and extensions relative to that script.
#
# Idempotent: does nothing when the stamp says the pinned version is already in place.
set -euo pipefail

MATHJAX_VERSION="${MATHJAX_VERSION:-3.2.2}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
npm_dir="$root/_vendor/npm"
dest="$root/_vendor/static/mathjax"
stamp="$root/_vendor/.mathjax-version"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$MATHJAX_VERSION" && -f "$dest/tex-chtml.js" ]]; then
    exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
    echo "vendor_mathjax: npm not found. Install Node.js and npm (Debian: apt-get install -y npm)," >&2
    echo "then run 'make book' again; the book loads MathJax from the site, never from a CDN." >&2
    exit 1
fi

src="$npm_dir/node_modules/mathjax"
if [[ ! -f "$src/package.json" ]] ||
    [[ "$(node -p "require('$src/package.json').version" 2>/dev/null)" != "$MATHJAX_VERSION" ]]; then
    echo "vendor_mathjax: npm install mathjax@$MATHJAX_VERSION into _vendor/npm"
    mkdir -p "$npm_dir"
    npm install --prefix "$npm_dir" --no-audit --no-fund --no-save --no-package-lock \
        --loglevel=error "mathjax@$MATHJAX_VERSION"
fi

es5="$src/es5"
rm -rf "$dest"
mkdir -p "$dest/output/chtml/fonts" "$dest/input/tex"
cp "$es5/tex-chtml.js" "$dest/"
cp -r "$es5/output/chtml/fonts/woff-v2" "$dest/output/chtml/fonts/"
cp -r "$es5/input/tex/extensions" "$dest/input/tex/"
cp -r "$es5/ui" "$es5/a11y" "$dest/"
cp "$src/LICENSE" "$dest/LICENSE"
echo "$MATHJAX_VERSION" >"$stamp"
echo "vendor_mathjax: MathJax $MATHJAX_VERSION in _vendor/static/mathjax ($(du -sh "$dest" | cut -f1))"
