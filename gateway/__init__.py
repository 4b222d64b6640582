"""lmdeploy-gateway: a secure, fast, OpenAI-compatible front door for lmdeploy api_server backends."""

__version__ = "0.1.0"
