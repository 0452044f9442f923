"""What the OpenTelemetry GenAI semantic conventions ask of a call, in each facade's words: the
operation a route performs. A route's operation is a well-known `gen_ai.operation.name` value; a
route that is no inference (a pull, an image upload) has none. (The token usage a box reports is
read by facades.usage.)
"""

from __future__ import annotations

OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/api/chat": "chat",
    "/api/v0/chat/completions": "chat",
    "/api/v1/chat": "chat",
    "/v1/completions": "text_completion",
    "/api/generate": "text_completion",
    "/api/v0/completions": "text_completion",
    "/v1/responses": "generate_content",
    "/v1/embeddings": "embeddings",
    "/api/embed": "embeddings",
    "/api/embeddings": "embeddings",
    "/api/v0/embeddings": "embeddings",
}
