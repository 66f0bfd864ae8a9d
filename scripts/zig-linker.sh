#!/usr/bin/env bash
# The linker of the manylinux wheel's target artifacts (scripts/build-wheel.sh
# sets it as CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER): zig's clang
# through cargo-zigbuild (both from PyPI), linking against glibc 2.28's
# symbol versions, so the library and the CLI load on any glibc >= 2.28
# (manylinux_2_28). cargo-zigbuild's `zig cc` adapts rustc's arguments to zig.
# CARGO_ZIGBUILD_ZIG_PATH (set by build-wheel.sh) is the zig binary of the
# ziglang wheel: pip's isolated build environment hides that wheel from
# `python3 -m ziglang`, where cargo-zigbuild would look otherwise.
exec cargo-zigbuild zig cc -- -g -target x86_64-linux-gnu.2.28 "$@"
