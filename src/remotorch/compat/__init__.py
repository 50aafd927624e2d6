"""Drop-in replacements for the APIs of tools remotorch users come from.

:mod:`remotorch.compat.octoml_profile` runs scripts written for
octoml-profile (whose service is gone) with one import line changed.
"""
