"""A vLLM KV connector that does nothing (benchmarks/connector_overhead.py): what vLLM's connector machinery costs a
request by itself, apart from what KvctlConnector does. Loaded by vLLM in the engine's processes
(``{"kv_connector": "NoopConnector", "kv_connector_module_path": "kvctl.lab.noop_connector", "kv_role": "kv_both"}``);
it finds no token anywhere and saves nothing. Never imported by kvctl itself.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):
    """Every hook of vLLM's v1 connector API, each doing nothing."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()
