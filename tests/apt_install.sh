#!/usr/bin/env bash
# Install a distribution package that some tests need (make postgres, make chromium), unless
# the variable SKIP_VAR is "skip". Never fails the build: the tests that need the package fail
# later, saying why, when it is still missing.
#   tests/apt_install.sh PACKAGE SKIP_VAR WHAT
set -u
package=$1 skip_var=$2 what=$3
if [ "${!skip_var:-}" = skip ]; then
  echo "make: $skip_var=skip: not installing $package"
elif command -v apt-get >/dev/null; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "$package" \
    || echo "make: could not install $package; $what will fail saying so"
else
  echo "make: no apt-get: install $package for $what"
fi
