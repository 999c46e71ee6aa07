"""Integrations of flashtile with other libraries, one module each, imported on demand:
``flashtile.integrations.transformers`` (Hugging Face transformers' attention interface).
Importing this package imports none of them."""
