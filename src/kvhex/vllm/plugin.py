"""The ``vllm.general_plugins`` entry point: registers kvhex's names with vLLM's factories.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
possibly more than once; each registration is skipped when the name is already known. After
it, ``spec_name: "KvhexOffloadingSpec"``, ``kv_connector: "KvhexOffloadingConnector"`` and a
secondary tier of ``type: "KvhexSecondaryTier"`` need no module path. Nothing is imported
from kvhex's vLLM adapter until vLLM builds one of them.
"""

from __future__ import annotations

MODULE = "kvhex.vllm"


def register() -> None:
    """Register the spec, the connector and the secondary tier type (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if "KvhexOffloadingSpec" not in OffloadingSpecFactory._registry:
        OffloadingSpecFactory.register_spec("KvhexOffloadingSpec", MODULE, "KvhexOffloadingSpec")
    if "KvhexOffloadingConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "KvhexOffloadingConnector", MODULE, "KvhexOffloadingConnector"
        )
    if "KvhexSecondaryTier" not in SecondaryTierFactory._registry:
        SecondaryTierFactory.register_tier("KvhexSecondaryTier", MODULE, "KvhexSecondaryTier")
