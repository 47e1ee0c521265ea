"""Contract suites shipped for third parties (and run by kvhex on its own built-ins).

Subclass a contract in your own test module and implement its factory method; pytest then
runs every check of the contract against your plugin::

    from kvhex.testing import EvictionPolicyContract

    class TestMyPolicy(EvictionPolicyContract):
        def make_policy(self, capacity):
            return MyPolicy(capacity)

Two contracts ship: ``EvictionPolicyContract`` (``make_policy(capacity)``) and
``TierStoreContract`` (``make_store(host)``). Run them with pytest
(``pip install 'kvhex[testing]'``).
"""

from kvhex.testing.policy_contract import EvictionPolicyContract, policy_key
from kvhex.testing.tier_store_contract import TierStoreContract

__all__ = ["EvictionPolicyContract", "TierStoreContract", "policy_key"]
