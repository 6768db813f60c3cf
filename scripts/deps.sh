#!/usr/bin/env bash
# Installs the Debian packages m3attn builds with, only those that are missing.
set -euo pipefail

need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in cmake ninja-build g++ libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev; do
  have_pkg "$pkg" || need+=("$pkg")
done
if ((${#need[@]} == 0)); then
  exit 0
fi
echo "m3attn: installing ${need[*]}"
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "m3attn: need root (or sudo) to install ${need[*]}" >&2; exit 1; }
  sudo=sudo
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
