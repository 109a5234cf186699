"""``/v1/files`` and ``/v1/batches``: OpenAI's Files and Batch API, so that the official SDK's batch
workflow runs unchanged.

Every route authenticates like the chat routes (``Authorization: Bearer <key>``) and sees only the
key's tenant's files and batches: another tenant's ids are 404, never 403. The database work runs on
worker threads. An upload has its own size limit (``Settings.batch_max_file_bytes``), not the
app-wide ``max_body_bytes``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from litestar import Request, Response, delete, get, post
from litestar._multipart import parse_multipart_form  # the parser Request.form() uses, fed a size-limited stream
from litestar.datastructures import UploadFile
from litestar.exceptions import ClientException
from litestar.openapi.spec import (
    Encoding,
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    RequestBody,
    Schema,
)
from litestar.params import FromPath, FromQuery, QueryParameter
from sqlmodel import Session

from switchyard.api.errors import BadRequest, NotFound, PayloadTooLarge
from switchyard.api.openapi import (
    API_KEY,
    BOOLEAN,
    INTEGER,
    STRING,
    array,
    documented,
    json_request_body,
    json_response,
    nullable,
    obj,
    v1_errors,
)
from switchyard.batch import intake
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.store import batches, files
from switchyard.store import errors as store_errors
from switchyard.store.db import in_transaction
from switchyard.store.keys import KeyIdentity
from switchyard.store.models import BATCH_STATUSES, Batch

T = TypeVar("T")

#: What an upload's body may carry beyond the file itself (multipart boundaries, headers, fields).
MULTIPART_SLACK = 64 * 1024
MAX_FILES_PAGE = 10_000
MAX_BATCHES_PAGE = 100


class BatchCreate(msgspec.Struct):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None


def _runtime(request: Request[Any, Any, Any]) -> GatewayRuntime:
    runtime: GatewayRuntime = request.app.state.runtime
    return runtime


async def _identity(request: Request[Any, Any, Any]) -> KeyIdentity:
    runtime = _runtime(request)
    return await runtime.auth.authenticate(request.headers.get("authorization"),
                                           runtime.policy.snapshot.document.resilience.dependencies.database)


async def _db(request: Request[Any, Any, Any], work: Callable[[Session], T]) -> T:
    """Run ``work`` in one transaction on a worker thread; the store's errors become API errors."""
    try:
        return await in_transaction(_runtime(request).engine, work)
    except store_errors.NotFound as exc:
        raise NotFound(str(exc)) from None
    except store_errors.TooLarge as exc:
        raise PayloadTooLarge(str(exc), param="file") from None
    except store_errors.InvalidParam as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    except store_errors.StoreError as exc:
        raise BadRequest(str(exc)) from None


def _ts(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


def file_object(info: files.FileInfo) -> dict[str, Any]:
    """OpenAI's ``FileObject``."""
    return {"id": info.id, "object": "file", "bytes": info.size, "created_at": _ts(info.created_at),
            "filename": info.filename, "purpose": info.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(batch: Batch) -> dict[str, Any]:
    """OpenAI's ``Batch``."""
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "errors": batch.errors,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window, "status": batch.status,
        "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _ts(batch.created_at), "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at), "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at), "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at), "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": {"total": batch.total_count, "completed": batch.completed_count,
                           "failed": batch.failed_count},
        "metadata": batch.user_metadata,
    }


def _json(content: Any, status: int = 200) -> Response[bytes]:
    return Response(msgspec.json.encode(content), status_code=status, media_type="application/json")


def _page(data: list[dict[str, Any]], has_more: bool) -> Response[bytes]:
    """OpenAI's list shape."""
    return _json({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                  "last_id": data[-1]["id"] if data else None, "has_more": has_more})


# ``limit``'s bounds, for the document (:func:`_limit` checks them, to name the parameter in its 400).
FilesPage = Annotated[int, QueryParameter(schema_extra={"minimum": 1, "maximum": MAX_FILES_PAGE})]
BatchesPage = Annotated[int, QueryParameter(schema_extra={"minimum": 1, "maximum": MAX_BATCHES_PAGE})]


def _limit(limit: int, most: int) -> int:
    if not 1 <= limit <= most:
        raise BadRequest(f"limit must be between 1 and {most}.", param="limit")
    return limit


# --- what the OpenAPI document says of them ------------------------------------------------

_FILE = obj({"id": STRING, "object": Schema(type=OpenAPIType.STRING, const="file"), "bytes": INTEGER,
             "created_at": INTEGER, "filename": STRING, "purpose": STRING, "status": STRING,
             "expires_at": nullable(OpenAPIType.INTEGER), "status_details": nullable(OpenAPIType.STRING)},
            ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
            description="OpenAI's FileObject.")
_NULLABLE_TIME = nullable(OpenAPIType.INTEGER)
_BATCH = obj({
    "id": STRING, "object": Schema(type=OpenAPIType.STRING, const="batch"), "endpoint": STRING,
    "errors": obj({"object": STRING, "data": array(obj({"line": nullable(OpenAPIType.INTEGER), "message": STRING,
                                                         "param": nullable(OpenAPIType.STRING),
                                                         "code": nullable(OpenAPIType.STRING)}))},
                  nullable_=True),
    "input_file_id": STRING, "completion_window": STRING,
    "status": Schema(type=OpenAPIType.STRING, enum=list(BATCH_STATUSES)),
    "output_file_id": nullable(OpenAPIType.STRING), "error_file_id": nullable(OpenAPIType.STRING),
    "created_at": INTEGER, **{f"{at}_at": _NULLABLE_TIME for at in (
        "in_progress", "expires", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")},
    "request_counts": obj({"total": INTEGER, "completed": INTEGER, "failed": INTEGER},
                          ["total", "completed", "failed"]),
    "metadata": obj({}, extra=True, nullable_=True),
}, ["id", "object", "endpoint", "input_file_id", "completion_window", "status", "created_at", "request_counts"],
    description="OpenAI's Batch.")


def _list_of(item: Schema) -> Schema:
    return obj({"object": Schema(type=OpenAPIType.STRING, const="list"), "data": array(item),
                "first_id": nullable(OpenAPIType.STRING), "last_id": nullable(OpenAPIType.STRING),
                "has_more": BOOLEAN}, ["object", "data", "first_id", "last_id", "has_more"])


_UPLOAD = RequestBody(required=True, content={"multipart/form-data": OpenAPIMediaType(
    schema=obj({"file": Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY,
                               description="The JSONL file: one request per line."),
                "purpose": Schema(type=OpenAPIType.STRING, enum=list(files.UPLOAD_PURPOSES))},
               ["file", "purpose"]),
    encoding={"file": Encoding(content_type="application/octet-stream")})})
_BATCH_CREATE = json_request_body(obj({
    "input_file_id": STRING,
    "endpoint": Schema(type=OpenAPIType.STRING, enum=list(batches.ENDPOINTS)),
    "completion_window": Schema(type=OpenAPIType.STRING, enum=list(batches.COMPLETION_WINDOWS)),
    "metadata": Schema(type=[OpenAPIType.OBJECT, OpenAPIType.NULL], additional_properties=STRING,
                       max_properties=intake.MAX_METADATA_KEYS),
}, ["input_file_id", "endpoint", "completion_window"]))
_CONTENT = OpenAPIResponse(description="The file's bytes.", content={"application/octet-stream": OpenAPIMediaType(
    schema=Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY))})
#: Every route: a bad parameter, no valid key, a bug, key lookups down (fail closed).
_ERRORS = v1_errors(400, 401, 500, 503)
_ONE = v1_errors(404)

CREATE_FILE = documented(security=API_KEY, body=_UPLOAD, responses={
    200: json_response("The file, stored.", _FILE), **_ERRORS, **v1_errors(413)})
#: (``after`` naming no file or batch of the caller's is a 404.)
LIST_FILES = documented(security=API_KEY, responses={200: json_response("A page of files.", _list_of(_FILE)),
                                                     **_ERRORS, **_ONE})
RETRIEVE_FILE = documented(security=API_KEY, responses={200: json_response("The file.", _FILE), **_ERRORS, **_ONE})
DOWNLOAD_FILE = documented(security=API_KEY, responses={200: _CONTENT, **_ERRORS, **_ONE})
DELETE_FILE = documented(security=API_KEY, responses={
    200: json_response("The file is deleted.", obj({"id": STRING, "object": Schema(type=OpenAPIType.STRING,
                                                                                    const="file"),
                                                     "deleted": BOOLEAN}, ["id", "object", "deleted"])),
    **_ERRORS, **_ONE})
CREATE_BATCH = documented(security=API_KEY, body=_BATCH_CREATE, responses={
    200: json_response("The batch (failed at once, with its errors, when its input is refused).", _BATCH),
    **_ERRORS, **_ONE, **v1_errors(413)})
LIST_BATCHES = documented(security=API_KEY, responses={200: json_response("A page of batches.", _list_of(_BATCH)),
                                                       **_ERRORS, **_ONE})
ONE_BATCH = documented(security=API_KEY, responses={200: json_response("The batch.", _BATCH), **_ERRORS, **_ONE})


# --- files ---------------------------------------------------------------------------------

async def _limited(request: Request[Any, Any, Any], most: int) -> AsyncGenerator[bytes, None]:
    """The request body, refused with 413 as soon as it is longer than ``most`` bytes."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > most:
        raise PayloadTooLarge(f"The upload is larger than the {most - MULTIPART_SLACK} bytes a file may have.",
                              param="file")
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > most:
            raise PayloadTooLarge(f"The upload is larger than the {most - MULTIPART_SLACK} bytes a file may have.",
                                  param="file")
        yield chunk


async def _upload(request: Request[Any, Any, Any], max_bytes: int) -> tuple[UploadFile, str]:
    """The multipart upload's ``file`` and ``purpose``."""
    content_type, options = request.content_type
    boundary = options.get("boundary")
    if content_type != "multipart/form-data" or not boundary:
        raise BadRequest("Upload the file as multipart/form-data with fields 'file' and 'purpose'.")
    try:
        form = await parse_multipart_form(stream=_limited(request, max_bytes + MULTIPART_SLACK),
                                          boundary=boundary.encode(),
                                          multipart_form_part_limit=request.app.multipart_form_part_limit)
    except ClientException as exc:
        raise BadRequest(f"Invalid multipart/form-data upload: {exc.detail}") from None
    upload, purpose = form.get("file"), form.get("purpose")
    for value in form.values():
        if isinstance(value, UploadFile) and value is not upload:
            await value.close()
    if not isinstance(upload, UploadFile):
        raise BadRequest("Missing required parameter: 'file' (a file part of the multipart upload).", param="file")
    if not isinstance(purpose, str):
        await upload.close()
        raise BadRequest("Missing required parameter: 'purpose'.", param="purpose")
    return upload, purpose


@post("/v1/files", operation_id="createFile", status_code=200, request_max_body_size=None,
      operation_class=CREATE_FILE)
async def create_file(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Upload a JSONL file (purpose ``batch``) for batches. The body limit is ``batch_max_file_bytes``
    (checked here while streaming: the app-wide limit is lifted for this route alone)."""
    identity = await _identity(request)
    max_bytes = _runtime(request).settings.batch_max_file_bytes
    upload, purpose = await _upload(request, max_bytes)
    try:
        content = await upload.read()
    finally:
        await upload.close()
    info = await _db(request, lambda s: files.create_file(s, identity.tenant_id, upload.filename, content, purpose,
                                                          max_bytes=max_bytes))
    return _json(file_object(info))


@get("/v1/files", operation_id="listFiles", operation_class=LIST_FILES)
async def list_files(request: Request[Any, Any, Any], after: FromQuery[str | None] = None,
                     limit: FilesPage = MAX_FILES_PAGE, order: FromQuery[Literal["asc", "desc"]] = "desc",
                     purpose: FromQuery[str | None] = None) -> Response[bytes]:
    """The caller's tenant's files, newest first (``order=asc``: oldest first), paginated by ``after``."""
    identity = await _identity(request)
    limit = _limit(limit, MAX_FILES_PAGE)
    found, more = await _db(request, lambda s: files.list_files(s, identity.tenant_id, purpose=purpose,
                                                                after=after, limit=limit, order=order))
    return _page([file_object(f) for f in found], more)


@get("/v1/files/{file_id:str}", operation_id="retrieveFile", operation_class=RETRIEVE_FILE)
async def retrieve_file(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[bytes]:
    """One of the caller's tenant's files."""
    identity = await _identity(request)
    return _json(file_object(await _db(request, lambda s: files.get_file(s, identity.tenant_id, file_id))))


@get("/v1/files/{file_id:str}/content", operation_id="downloadFile", operation_class=DOWNLOAD_FILE)
async def file_content(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[bytes]:
    """The content of one of the caller's tenant's files."""
    identity = await _identity(request)
    _, content = await _db(request, lambda s: files.file_content(s, identity.tenant_id, file_id))
    return Response(content, media_type="application/octet-stream")


@delete("/v1/files/{file_id:str}", operation_id="deleteFile", status_code=200, operation_class=DELETE_FILE)
async def delete_file(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[bytes]:
    """Delete one of the caller's tenant's files (batches made from it are not affected)."""
    identity = await _identity(request)
    await _db(request, lambda s: files.delete_file(s, identity.tenant_id, file_id))
    return _json({"id": file_id, "object": "file", "deleted": True})


# --- batches -------------------------------------------------------------------------------

@post("/v1/batches", operation_id="createBatch", status_code=200, operation_class=CREATE_BATCH)
async def create_batch(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Create a batch from an uploaded file; its input is validated at once (a bad line makes a
    ``failed`` batch whose ``errors`` say which and why)."""
    identity = await _identity(request)
    try:
        body = msgspec.json.decode(await request.body(), type=BatchCreate)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid request body: {exc}") from None
    batch = await _db(request, lambda s: intake.create_batch(
        s, tenant_id=identity.tenant_id, key_id=identity.key_id, input_file_id=body.input_file_id,
        endpoint=body.endpoint, completion_window=body.completion_window, metadata=body.metadata))
    return _json(batch_object(batch))


@get("/v1/batches", operation_id="listBatches", operation_class=LIST_BATCHES)
async def list_batches(request: Request[Any, Any, Any], after: FromQuery[str | None] = None,
                       limit: BatchesPage = 20) -> Response[bytes]:
    """The caller's tenant's batches, newest first, paginated by ``after``."""
    identity = await _identity(request)
    limit = _limit(limit, MAX_BATCHES_PAGE)
    found, more = await _db(request, lambda s: batches.list_batches(s, identity.tenant_id, after=after, limit=limit))
    return _page([batch_object(x) for x in found], more)


@get("/v1/batches/{batch_id:str}", operation_id="retrieveBatch", operation_class=ONE_BATCH)
async def retrieve_batch(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[bytes]:
    """One of the caller's tenant's batches."""
    identity = await _identity(request)
    return _json(batch_object(await _db(request, lambda s: batches.get_batch(s, identity.tenant_id, batch_id))))


@post("/v1/batches/{batch_id:str}/cancel", operation_id="cancelBatch", status_code=200, operation_class=ONE_BATCH)
async def cancel_batch(request: Request[Any, Any, Any], batch_id: FromPath[str]) -> Response[bytes]:
    """Cancel a batch: ``cancelling`` while lines still run, then ``cancelled`` (at once when none does)."""
    identity = await _identity(request)
    return _json(batch_object(await _db(request, lambda s: batches.cancel_batch(s, identity.tenant_id, batch_id))))


ROUTES = [create_file, list_files, retrieve_file, file_content, delete_file, create_batch, list_batches,
          retrieve_batch, cancel_batch]
