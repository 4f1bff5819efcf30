#!/usr/bin/env bash
# Builds, once, the venv that `make test-pythons` runs the suite in for one Python version.
#
#   tests/pythons.sh VERSION ROOT TORCH_SPEC [PIN...]
#
# The venv is ROOT/VERSION, outside the checkout, made with pyenv's (or PATH's) pythonVERSION; it holds torch
# (TORCH_SPEC first, so that the rest does not choose another build), the package's [examples,test] extras and
# the extra PINs (e.g. gymnasium==1.3.0: the lowest release setup.cfg accepts; a torch pin replaces TORCH_SPEC). It is keyed by a hash of
# setup.cfg, the interpreter and the pins: a changed requirement rebuilds it, an unchanged one costs nothing. The
# suite runs with the checkout on PYTHONPATH, so the copy of the package installed there is never the one tested.
set -euo pipefail

version=$1 root=$2 torch_spec=$3
shift 3
pins=()
for pin in "$@"; do  # a torch pin among the PINs replaces TORCH_SPEC
    case "$pin" in torch[=\<\>~]*) torch_spec=$pin ;; *) pins+=("$pin") ;; esac
done
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/$version"

python=
for candidate in "python$version" "$(pyenv root 2>/dev/null)/versions/$version"*/bin/"python$version" \
    "$HOME/.pyenv/versions/$version"*/bin/"python$version"; do
    if "$candidate" -c 'import sys' >/dev/null 2>&1; then
        python=$(command -v "$candidate")
        break
    fi
done
if [ -z "$python" ]; then
    echo "tests/pythons.sh: no Python $version found (on PATH as python$version, or in pyenv)" >&2
    exit 1
fi

key=$( (cat "$here/setup.cfg"; "$python" -VV; echo "$torch_spec" "${pins[@]}") | sha256sum | cut -c1-16)
if [ -f "$venv/.key" ] && [ "$(cat "$venv/.key")" = "$key" ]; then
    exit 0
fi
echo "tests/pythons.sh: building $venv with $("$python" -V)"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "$torch_spec"
"$venv/bin/python" -m pip install --quiet "$here[examples,test]" "$torch_spec" "${pins[@]}"
echo "$key" > "$venv/.key"
