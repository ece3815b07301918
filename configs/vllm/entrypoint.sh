#!/bin/sh
# Container entrypoint for vllm-prefill.env: VLLM_ARGS is split like a shell command line
# (quotes honoured, so the JSON of --kv-transfer-config stays one argument), then vLLM starts.
# PYTHON and VLLM_MODULE override the interpreter and the server module.
set -eu
eval "set -- ${VLLM_ARGS:-} \"\$@\""
exec "${PYTHON:-python3}" -m "${VLLM_MODULE:-vllm.entrypoints.openai.api_server}" "$@"
