"""The one vocabulary of why a box did not take a call (router.core.refusal judges; this module
only names), apart so that the box kinds' table (router.core.kinds) can name a kind's codes."""

from __future__ import annotations

from enum import StrEnum


class RefusalCode(StrEnum):
    """Why a box did not take a call, or failed it: the one vocabulary of the upstream pool's
    errors, the judge (this module), the route log's `error` and attempts, and the metrics'
    `reason` label. A StrEnum, so a code is its stable string wherever it is written; a value is
    never renamed."""

    # the exchange itself (router.upstream.pool)
    UPSTREAM_ERROR = "upstream_error"
    UNREACHABLE = "unreachable"
    CONNECTION_LOST = "connection_lost"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    STREAM_IDLE_TIMEOUT = "stream_idle_timeout"
    BAD_RESPONSE = "bad_response"
    CANCELLED = "cancelled"
    # a refusing status (rule 2)
    HTTP_502 = "http_502"
    HTTP_503 = "http_503"
    HTTP_504 = "http_504"
    # what the answer says (rules 3-6)
    MODEL_NOT_FOUND = "model_not_found"
    NO_MODEL_LOADED = "no_model_loaded"
    STREAM_ERROR = "stream_error"
    NOT_FOUND_ERROR = "not_found_error"
    # hugpy's placement failures (contracts/hugpy-wrapper.md §4)
    LOAD_ERROR = "load_error"
    INSUFFICIENT_RESOURCES = "insufficient_resources"
    PROFILE_MATERIALIZING = "profile_materializing"
    PROFILE_ERROR = "profile_error"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    FIRST_CALL_EXCLUSIVE = "first_call_exclusive"
    CENTRAL_SOURCE_CONSTRAINT = "central_source_constraint"
    MAINTENANCE = "maintenance"
    WORKER_RESERVED = "worker_reserved"
