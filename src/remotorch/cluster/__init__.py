"""remotorch workers on a cluster manager: :class:`RayCluster` runs them inside Ray actors.

Importing this package does not import Ray; starting a ``RayCluster`` does
(``pip install 'remotorch[ray]'``).
"""

from __future__ import annotations

from .ray import RayCluster

__all__ = ["RayCluster"]
