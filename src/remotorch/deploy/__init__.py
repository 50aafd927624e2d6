"""Launching remotorch workers elsewhere: :mod:`remotorch.deploy.modal` (Modal GPU containers).

The worker is the same ``remotorch serve``; this package only starts it
somewhere and hands back how to reach it. Importing it imports no platform
SDK; :mod:`remotorch.deploy.modal` needs ``pip install remotorch[modal]``.
"""
