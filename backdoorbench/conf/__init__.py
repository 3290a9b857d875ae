"""Hydra configuration tree of backdoorbench (a package so it ships inside the wheel)."""
