#!/usr/bin/env bash
# Builds the virtualenv of each real simulator framework that the integration tests run in, once.
#
#   sims/build.sh [NAME...]      NAME: a file sims/requirements/NAME.txt (default: all of them)
#
# Each venv lies in ${TORCH_ROLLOUT_SIMS:-$HOME/.cache/torch_rollout/sims}/NAME, outside the checkout, and is
# keyed by a hash of its requirements file (and of the Python it was made with): a changed pin rebuilds it,
# an unchanged one costs nothing. The project itself is not installed there: the tests run with the checkout on
# PYTHONPATH. A requirements file names its Python on a line '# python: 3.X'; a 'torch==' line is installed
# before the rest, so that pip takes the CPU build that lies on this machine instead of letting a framework
# pull a CUDA build. ManiSkill's SAPIEN needs a Vulkan device, which on a machine without a GPU means mesa's
# software driver from Debian's bookworm-backports (that of Debian 12 itself is too old): installed here, as
# root, once.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=${TORCH_ROLLOUT_SIMS:-$HOME/.cache/torch_rollout/sims}

find_python() {  # find_python 3.12: an interpreter of that version, on PATH or in pyenv
    local version=$1 candidate
    for candidate in "python$version" "$(pyenv root 2>/dev/null)/versions/$version"*/bin/"python$version"; do
        if "$candidate" -c 'import sys' >/dev/null 2>&1; then
            command -v "$candidate"
            return
        fi
    done
    echo "sims/build.sh: no Python $version found (on PATH as python$version, or in pyenv)" >&2
    return 1
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

vulkan_for_sapien() {  # mesa's lavapipe from bookworm-backports (mesa 25), once
    local installed
    installed=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)
    if [ -n "$installed" ] && dpkg --compare-versions "$installed" ge 25; then
        return
    fi
    if [ ! -f /etc/os-release ] || ! grep -q '^VERSION_CODENAME=bookworm' /etc/os-release; then
        echo "sims/build.sh: ManiSkill needs a Vulkan driver (mesa 25 or later); install one by hand" \
            "on this system (found mesa-vulkan-drivers '${installed:-none}')" >&2
        return 1
    fi
    local sources=/etc/apt/sources.list.d/bookworm-backports.sources
    if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        printf '%s\n' 'Types: deb' 'URIs: http://deb.debian.org/debian' 'Suites: bookworm-backports' \
            'Components: main' 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' \
            | as_root tee "$sources" >/dev/null
    fi
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports \
        mesa-vulkan-drivers libvulkan1
}

build() {  # build NAME: the venv of sims/requirements/NAME.txt, unless it is there with the same hash
    local name=$1 requirements="$here/requirements/$1.txt" version python key venv torch_pin
    if [ ! -f "$requirements" ]; then
        echo "sims/build.sh: no $requirements; the frameworks are: $(cd "$here/requirements" && ls ./*.txt \
            | sed 's|^\./||; s|\.txt$||' | tr '\n' ' ')" >&2
        return 1
    fi
    version=$(sed -n 's/^# python: *//p' "$requirements")
    python=$(find_python "${version:?$requirements names no '# python: 3.X' line}")
    key=$( { cat "$requirements"; "$python" -VV; } | sha256sum | cut -c1-16)
    venv="$root/$name"
    if [ "$name" = maniskill ]; then
        vulkan_for_sapien
    fi
    if [ "$(cat "$venv/.requirements-hash" 2>/dev/null)" = "$key" ]; then
        return
    fi
    echo "sims/build.sh: building $venv (Python $version, requirements $key)" >&2
    local start=$SECONDS
    rm -rf "$venv"
    mkdir -p "$root"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -qq --upgrade pip
    torch_pin=$(grep -E '^torch==' "$requirements" || true)
    if [ -n "$torch_pin" ]; then
        "$venv/bin/python" -m pip install -qq "$torch_pin"
    fi
    "$venv/bin/python" -m pip install -qq -r "$requirements"
    echo "$key" >"$venv/.requirements-hash"  # last: an interrupted build starts again
    echo "sims/build.sh: built $name in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)" >&2
}

if [ $# -eq 0 ]; then
    set -- $(cd "$here/requirements" && ls ./*.txt | sed 's|^\./||; s|\.txt$||')
fi
for name in "$@"; do
    build "$name"
done
