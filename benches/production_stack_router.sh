#!/bin/sh
# The vLLM production-stack router, as an external arm of `kvroute bench compare`:
#
#   PRODUCTION_STACK_ROUTER=/path/to/venv/bin/vllm-router kvroute bench compare ... \
#       --external 'prodstack=benches/production_stack_router.sh {port} {workers_csv} MODEL [ROUTING]'
#
# MODEL is the name the workers serve (the simulator's preset names its model; `kvroute sim
# --list-presets`). ROUTING is the router's routing logic: `prefixaware` (the default: the worker
# holding the longest prefix of the request's text) or `session` (a hash ring over a session
# header, here `x-session-id`; run the bench with `--session-header x-session-id` so that each
# conversation names itself). The router is not on PyPI under its own name (the `vllm-router` package there
# is vllm-project/router's), so it is installed from its repository, with Python 3.12 or later:
#
#   git clone https://github.com/vllm-project/production-stack
#   python3.12 -m venv ps && ps/bin/pip install ./production-stack
#   export PRODUCTION_STACK_ROUTER=$PWD/ps/bin/vllm-router
#
# Its static service discovery wants one model name per backend, which the bench's
# {workers_csv} does not carry: this script repeats MODEL for each.
set -eu
if [ $# -lt 3 ] || [ $# -gt 4 ]; then
    echo "usage: $0 PORT WORKERS_CSV MODEL [prefixaware|session]" >&2
    exit 2
fi
port=$1
workers=$2
model=$3
routing=${4:-prefixaware}
case $routing in
    prefixaware) set -- ;;
    session) set -- --session-key x-session-id ;;
    *)
        echo "$0: routing must be prefixaware or session, not $routing" >&2
        exit 2
        ;;
esac
router=${PRODUCTION_STACK_ROUTER:?set PRODUCTION_STACK_ROUTER to the production-stack vllm-router}
models=$(echo "$workers" | awk -F, -v m="$model" '{ for (i = 1; i <= NF; i++) printf "%s%s", (i > 1 ? "," : ""), m }')
exec "$router" --host 127.0.0.1 --port "$port" --service-discovery static \
    --static-backends "$workers" --static-models "$models" \
    --routing-logic "$routing" "$@" --log-level warning
