#!/usr/bin/env bash
# The README's first command: build flowmoe and run its main job, fm-train:
# a small MoE model trained with every recipe side by side (bf16,
# fp8-blockwise, fp8-flow, fp8-flow-fp4), about a minute on 2 CPU cores.
#
#   tools/demo.sh [fm-train arguments...]     e.g. tools/demo.sh --steps 500 --recipes bf16,fp8-flow
#
# Needs python3 and a C compiler. Installs meson and ninja when they are
# missing or too old, into .tools/ of this checkout (never system-wide, except
# python3-venv through apt-get when run as root on a bare Debian/Ubuntu).
# Configures build/ (the CUDA backend too when nvcc is found), builds, and runs
# fm-train with the arguments given (--backend cuda for the GPU; the loss
# curves land in out/fm-train/ unless --out says otherwise). Safe to run again:
# every step that is already done is skipped.
#
# Environment: FM_BUILD_DIR (default build), FM_JOBS (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${FM_BUILD_DIR:-build}
jobs=${FM_JOBS:-$(nproc 2>/dev/null || echo 2)}
tools=$root/.tools
meson_min=1.1 # meson.build's meson_version

say() { printf 'demo.sh: %s\n' "$*" >&2; }
die() {
    printf 'demo.sh: error: %s\n' "$*" >&2
    exit 1
}

version_ge() { # a >= b, dotted versions
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

meson_usable() {
    command -v meson >/dev/null 2>&1 || return 1
    local v
    v=$(meson --version 2>/dev/null) || return 1
    version_ge "$v" "$meson_min"
}

tools_usable() { meson_usable && ninja --version >/dev/null 2>&1; }

# Earlier runs' installs come first on PATH.
use_local_tools() {
    if [ -x "$tools/venv/bin/meson" ]; then
        export PATH="$tools/venv/bin:$PATH"
    elif [ -x "$tools/bin/meson" ]; then
        export PYTHONPATH="$tools/py${PYTHONPATH:+:$PYTHONPATH}"
        export PATH="$tools/bin:$PATH"
    fi
}

# A virtual environment: its scripts know their interpreter, so ninja can
# re-run meson later without any environment set up.
install_venv() {
    python3 -m venv "$tools/venv" >/dev/null 2>&1 || {
        rm -rf "$tools/venv"
        return 1
    }
    say "installing meson and ninja into $tools/venv (pip)"
    "$tools/venv/bin/python" -m pip install --quiet --disable-pip-version-check meson ninja || {
        rm -rf "$tools/venv"
        die "pip could not install meson and ninja (offline?); install them yourself: python3 -m pip install meson ninja"
    }
    export PATH="$tools/venv/bin:$PATH"
}

# No venv module (Debian without python3-venv) but a pip: a plain target
# directory, which PEP 668 ("externally managed environment") allows, and
# wrappers that put it on PYTHONPATH.
install_target() {
    say "installing meson and ninja into $tools/py (pip --target)"
    python3 -m pip install --quiet --disable-pip-version-check --upgrade --target "$tools/py" meson ninja ||
        die "pip could not install meson and ninja (offline?); install them yourself: python3 -m pip install meson ninja"
    mkdir -p "$tools/bin"
    local t
    for t in meson ninja; do
        [ -f "$tools/py/bin/$t" ] || die "pip installed no '$t' under $tools/py/bin"
        rm -f "$tools/bin/$t"
        if [ "$(head -c 2 "$tools/py/bin/$t")" = "#!" ]; then
            # shellcheck disable=SC2016 # $PYTHONPATH and $@ belong to the wrapper
            printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 "%s" "$@"\n' \
                "$tools/py" "$tools/py/bin/$t" >"$tools/bin/$t"
            chmod +x "$tools/bin/$t"
        else # the ninja wheel ships the executable itself
            ln -s "$tools/py/bin/$t" "$tools/bin/$t"
        fi
    done
    export PYTHONPATH="$tools/py${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$tools/bin:$PATH"
}

ensure_build_tools() {
    tools_usable && return 0
    use_local_tools
    tools_usable && return 0
    command -v python3 >/dev/null 2>&1 || die "python3 is needed to install meson and ninja; install python3 first"
    if command -v meson >/dev/null 2>&1 && ! meson_usable; then
        say "meson $(meson --version 2>/dev/null || echo '?') is older than $meson_min; installing a newer one locally"
    fi
    install_venv && tools_usable && return 0
    if python3 -m pip --version >/dev/null 2>&1; then
        install_target
        tools_usable && return 0
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "python3 has neither venv nor pip here; installing python3-venv and python3-pip with apt-get"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip \
            >/dev/null; }; then
            die "apt-get could not install python3-venv python3-pip"
        fi
        install_venv && tools_usable && return 0
    fi
    die "could not install meson (>= $meson_min) and ninja: install python3-venv or python3-pip (Debian/Ubuntu:" \
        "sudo apt-get install python3-venv), or meson and ninja themselves, then run this again"
}

ensure_compiler() {
    local c
    for c in "${CC:-}" cc gcc clang; do
        [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && return 0
    done
    die "no C compiler found (cc, gcc or clang); on Debian/Ubuntu: sudo apt-get install gcc"
}

# meson finds nvcc on PATH only; the usual install location is not on it.
find_cuda() {
    if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH="$PATH:/usr/local/cuda/bin"
    fi
    if command -v nvcc >/dev/null 2>&1; then
        say "CUDA: nvcc at $(command -v nvcc); the CUDA backend is built too (run with --backend cuda)"
    else
        say "CUDA: no nvcc found; building the CPU backend only"
    fi
}

configure() {
    if [ -f "$build/build.ninja" ]; then
        return 0 # ninja re-runs meson by itself when a meson.build changed
    fi
    if [ -d "$build/meson-private" ]; then
        say "$build/ holds an unfinished configuration; configuring it again from scratch"
        meson setup --wipe "$build"
    else
        say "configuring $build/"
        meson setup "$build"
    fi
}

ensure_compiler
ensure_build_tools
say "using meson $(meson --version) and ninja $(ninja --version)"
find_cuda
configure
say "building in $build/ ($jobs jobs)"
ninja -C "$build" -j "$jobs" tools/fm-train
exe=$build/tools/fm-train
[ -x "$exe" ] || die "the build did not produce $exe"
say "running $exe${*:+ $*}"
exec "$exe" "$@"
