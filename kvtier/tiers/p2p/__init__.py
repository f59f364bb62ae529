"""The peer-to-peer tier: kvtier nodes serve each other's primary tiers over TCP."""

from kvtier.tiers.p2p.tier import AUTH_FAILURES, FRAMES_REJECTED, PeerTier

__all__ = ["AUTH_FAILURES", "FRAMES_REJECTED", "PeerTier"]
