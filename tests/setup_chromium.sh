#!/usr/bin/env bash
# Make a headless Chromium available for the browser test (tests/test_ui_browser.py), from Debian's packages.
#
# Prints two lines on success:  CHROMIUM=<executable>  and  LD_LIBRARY_PATH=<dirs or empty>.
#   1. $HF_PAGED_CHROMIUM, when set, is used as is.
#   2. /usr/lib/chromium/chromium-headless-shell, when it already runs.
#   3. As root: apt-get install -y --no-install-recommends chromium-headless-shell.
#   4. Otherwise (or with HF_PAGED_CHROMIUM_NO_ROOT=1): apt-get download the package and every package an
#      install would add, and dpkg -x them into ${HF_PAGED_CACHE:-~/.cache/hf_paged}/chromium; the browser then
#      runs with LD_LIBRARY_PATH pointing into that folder.
# Exits non-zero, with the reason on stderr, when no browser can be set up.
set -euo pipefail

SYSTEM_BIN=/usr/lib/chromium/chromium-headless-shell
CACHE="${HF_PAGED_CACHE:-$HOME/.cache/hf_paged}/chromium"
ROOT_DIR="$CACHE/root"
LOCAL_BIN="$ROOT_DIR/usr/lib/chromium/chromium-headless-shell"

say() { echo "setup_chromium: $*" >&2; }

lib_path() {  # library folders inside the extracted packages
  local dirs=()
  for d in "$ROOT_DIR/usr/lib/x86_64-linux-gnu" "$ROOT_DIR/lib/x86_64-linux-gnu" \
           "$ROOT_DIR/usr/lib/aarch64-linux-gnu" "$ROOT_DIR/lib/aarch64-linux-gnu" \
           "$ROOT_DIR/usr/lib/x86_64-linux-gnu/pulseaudio" "$ROOT_DIR/usr/lib/chromium"; do
    [ -d "$d" ] && dirs+=("$d")
  done
  local IFS=:
  echo "${dirs[*]:-}"
}

runs() {  # runs BIN [LD_LIBRARY_PATH]
  LD_LIBRARY_PATH="${2:-${LD_LIBRARY_PATH:-}}" timeout 60 "$1" --headless --no-sandbox --disable-gpu --version \
    >/dev/null 2>&1 || LD_LIBRARY_PATH="${2:-${LD_LIBRARY_PATH:-}}" timeout 60 "$1" --version >/dev/null 2>&1
}

report() { echo "CHROMIUM=$1"; echo "LD_LIBRARY_PATH=${2:-}"; exit 0; }

if [ -n "${HF_PAGED_CHROMIUM:-}" ]; then
  [ -x "$HF_PAGED_CHROMIUM" ] || { say "HF_PAGED_CHROMIUM=$HF_PAGED_CHROMIUM is not an executable"; exit 1; }
  report "$HF_PAGED_CHROMIUM" ""
fi

no_root="${HF_PAGED_CHROMIUM_NO_ROOT:-}"
if [ -z "$no_root" ] && [ -x "$SYSTEM_BIN" ] && runs "$SYSTEM_BIN"; then
  report "$SYSTEM_BIN" ""
fi
if [ -x "$LOCAL_BIN" ] && runs "$LOCAL_BIN" "$(lib_path)"; then
  report "$LOCAL_BIN" "$(lib_path)"
fi

have_lists() { ls /var/lib/apt/lists/ 2>/dev/null | grep -q '_Packages'; }

if [ -z "$no_root" ] && [ "$(id -u)" = 0 ]; then
  say "installing chromium-headless-shell with apt-get (root)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends chromium-headless-shell >&2; then
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends chromium-headless-shell >&2
  fi
  if [ -x "$SYSTEM_BIN" ] && runs "$SYSTEM_BIN"; then
    report "$SYSTEM_BIN" ""
  fi
  say "apt-get installed chromium-headless-shell but $SYSTEM_BIN does not run"
  exit 1
fi

# Without root: download the packages an install would add and unpack them into the cache folder.
say "unpacking chromium-headless-shell and its missing libraries into $ROOT_DIR (no root needed)"
mkdir -p "$CACHE/debs" "$ROOT_DIR"
APT_OPTS=()
if ! have_lists || [ -d "$CACHE/apt/lists" ]; then
  # No package lists on this machine (or we made our own before): fetch them into the cache, as any user.
  mkdir -p "$CACHE/apt/lists/partial" "$CACHE/apt/cache/archives/partial"
  APT_OPTS=(-o "Dir::State::Lists=$CACHE/apt/lists" -o "Dir::Cache=$CACHE/apt/cache" -o "Debug::NoLocking=1")
  apt-get "${APT_OPTS[@]}" update -q >&2
fi
mapfile -t PKGS < <(apt-get "${APT_OPTS[@]}" -s install --no-install-recommends chromium-headless-shell 2>/dev/null \
                    | awk '/^Inst /{print $2}')
if [ "${#PKGS[@]}" -eq 0 ]; then
  # Nothing to add according to apt (chromium-headless-shell may be installed for another user): take it alone.
  PKGS=(chromium-headless-shell chromium-common)
fi
say "packages: ${PKGS[*]}"
(cd "$CACHE/debs" && apt-get "${APT_OPTS[@]}" download "${PKGS[@]}" >&2)
for deb in "$CACHE"/debs/*.deb; do
  dpkg -x "$deb" "$ROOT_DIR"
done
if [ -x "$LOCAL_BIN" ] && runs "$LOCAL_BIN" "$(lib_path)"; then
  report "$LOCAL_BIN" "$(lib_path)"
fi
say "unpacked $LOCAL_BIN does not run; missing libraries:"
LD_LIBRARY_PATH="$(lib_path)" ldd "$LOCAL_BIN" 2>&1 | grep "not found" >&2 || true
exit 1
