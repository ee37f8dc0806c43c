#!/usr/bin/env bash
# Tools some tests use that pip does not provide. Best effort: prints what it could not do and
# exits 0, so it never fails a test run on its own (the tests that need a tool skip without it).
#   docker-compose   Debian's package (Compose v1); tests/test_deploy_files.py validates
#                    docker-compose.yml with `docker-compose config -q`, which needs no daemon.
set -uo pipefail

if command -v docker-compose >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-test-tools: docker-compose is missing; as root: apt-get install -y docker-compose" \
         "(the compose validation tests will be skipped)" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-tools: docker-compose is missing and this is not a Debian/Ubuntu system;" \
         "install docker-compose (v1) or the compose plugin's standalone binary yourself" >&2
    exit 0
fi
echo "install-test-tools: installing docker-compose with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; then
    docker-compose version --short >&2 || true
else
    echo "install-test-tools: apt-get install docker-compose failed (the compose validation tests" \
         "will be skipped)" >&2
fi
exit 0
