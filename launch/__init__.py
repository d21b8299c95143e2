"""Deployment recipes: several sgrec servers behind sglang-router and Caddy (see launch/README.md)."""
