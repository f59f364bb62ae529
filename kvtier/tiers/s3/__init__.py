"""The S3 tier: chunks as verified objects in a bucket of any S3-speaking server.

:mod:`~kvtier.tiers.s3.tier` decides what to ask for (lookups, stores, loads);
:mod:`~kvtier.tiers.s3.client` sends the requests (retries, deadlines, bodies);
:mod:`~kvtier.tiers.s3.settings` parses the parameters.
"""

from kvtier.tiers.s3.client import S3Client, S3TierError
from kvtier.tiers.s3.settings import S3Settings
from kvtier.tiers.s3.tier import S3Tier

__all__ = ["S3Client", "S3Settings", "S3Tier", "S3TierError"]
