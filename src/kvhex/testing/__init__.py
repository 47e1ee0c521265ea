"""Contract suites shipped for third parties (and run by kvhex on its own built-ins).

Subclass a contract in your own test module and implement its factory method; pytest then
runs every check of the contract against your plugin::

    from kvhex.testing import CrashContract, EvictionPolicyContract, TierStoreContract

    class TestMyPolicy(EvictionPolicyContract):
        def make_policy(self, capacity):
            return MyPolicy(capacity)

    class TestMyTier(TierStoreContract, CrashContract):  # CrashContract: persistent tiers
        @pytest.fixture(autouse=True)
        def _root(self, tmp_path):
            self.root = tmp_path  # one storage per check, the same on every call in it

        def make_store(self, host):
            return MyTierStore(host, str(self.root), capacity_bytes=1 << 24)

        def make_sized_store(self, host, capacity_blocks):  # optional
            return MyTierStore(host, str(self.root), capacity_bytes=capacity_blocks * ...)

        def check_recovered(self, store):  # optional, CrashContract
            assert my_fsck(self.root).clean

Four contracts ship, all run with pytest (``pip install 'kvhex[testing]'``):

* ``CodecContract``: ``make_codec()`` (a ``kvhex.codecs`` codec): sizes honest, round trips
  (stable decodes for a lossy codec, ``lossy = True``), input that is no encoding refused,
  another tenant's or key's block refused by a keyed codec, threads, chains.
* ``EvictionPolicyContract``: ``make_policy(capacity)``.
* ``TierStoreContract``: ``make_store(host)``. The basic port checks, deletes naming a key
  twice, and the order checks of ``OrderContract`` (two jobs, or a job and a delete, on one
  key in every order the port allows; the racy shapes repeated ``race_trials`` times). The
  checks that need the tier's capacity (a put right after a delete at full capacity; no slot
  leaked after the order checks) use ``make_sized_store(host, capacity_blocks)`` when the
  class implements it, else ``make_store`` with the class attribute ``capacity_blocks`` (how
  many blocks of ``slot_bytes`` it holds), else they skip saying so. Deletes are checked only
  for a tier that has ``delete`` (``kvhex.ports.tier_store.Deletes``, optional: kvhex never
  deletes from a tier); for another one the delete checks skip, saying so, and the other
  checks delete nothing.
* ``CrashContract`` (opt-in, for tiers whose blocks outlive the process): writer processes
  killed with ``SIGKILL`` ``crash_cycles`` times, then the tier reopened and audited;
  ``check_recovered(store)`` is the hook for a storage check. The writers are started with
  the "spawn" context and get the test instance by pickle: the class must be a module-level
  class of a test module pytest imports by name (its default import mode), and what the
  factory needs must be plain attributes (paths, URLs). ``shared_storage = True`` for tiers
  several instances may open at once.

Payloads are ``block_payload(key, nbytes)`` of keys ``tier_key(i)``, so any byte served can
be verified. ``TierKit``'s helpers (``new_host``, ``open_store``, ``new_job``, ``submit``,
``run_job``, ``fill``, ``spoil``, ``put_all``, ``probe``, ``get_all``, ``check_bytes``, ...)
are public, for a tier's own checks. Class attributes size everything (``slot_bytes``,
``race_bulk_blocks``, ``race_slot_bytes``, ``race_wide_slot_bytes``, ``crash_keys``,
``crash_run_s``, ...): a slow tier may lower them.
"""

from kvhex.testing.codec_contract import CodecContract, codec_key, kv_like
from kvhex.testing.policy_contract import EvictionPolicyContract, policy_key
from kvhex.testing.tier_crash import CrashContract
from kvhex.testing.tier_kit import TierKit, block_payload, tier_key
from kvhex.testing.tier_order import OrderContract
from kvhex.testing.tier_store_contract import TierStoreContract

__all__ = [
    "CodecContract",
    "CrashContract",
    "EvictionPolicyContract",
    "OrderContract",
    "TierKit",
    "TierStoreContract",
    "block_payload",
    "codec_key",
    "kv_like",
    "policy_key",
    "tier_key",
]
