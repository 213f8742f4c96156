"""The updater: takes a trained agent's result and files, keeps it if it makes the top K.

Order of work for one submission, chosen so that bad input or a failure stores nothing:

1. read the body (size-limited while streaming: 413), validate the ``result`` part (422);
2. stream each file part into a staging temp file while hashing; a digest that differs from the
   declared one discards every temp file (400);
3. *hold* the digests in Redis (the collector will not delete a blob being uploaded), move the
   files into the content-addressed store (atomic rename / single PUT);
4. one Lua script decides and writes everything: idempotency by submission id, top-K check,
   candidate hash, ZADD, eviction of the worst, blob reference counts, lineage entries.

A blob stored in step 3 whose submission is then rejected (or whose script never ran because
Redis went away) is referenced by nothing; the collector removes it later.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from services.checkpoint_store import BlobStore, StagedBlob, StagingWriter
from services.contracts.leaderboard import SubmissionResponse, SubmissionResult
from services.leaderboard.metrics import LeaderboardMetrics
from services.leaderboard.store import LeaderboardStore, StoreBusyError, new_id
from services.logs import get_logger

log = get_logger(__name__)

# How long an upload's hold on its blobs lasts if the updater dies before releasing it.
UPLOAD_HOLD_S = 3600.0


class PayloadTooLargeError(Exception):
    def __init__(self, limit: int):
        super().__init__(f"request body larger than the {limit}-byte limit")
        self.limit = limit


class BadSubmissionError(Exception):
    """400: the request is well-formed but its content is wrong (hash mismatch)."""


def _validation_error(loc: tuple[Any, ...], msg: str, kind: str = "value_error") -> Exception:
    return RequestValidationError(
        [{"type": kind, "loc": ("body", *loc), "msg": msg, "input": None}]
    )


async def _limited(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    """The body, failing as soon as it passes ``limit`` (a lying or absent Content-Length)."""
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise PayloadTooLargeError(limit)
        yield chunk


def parse_result(raw: bytes | str) -> SubmissionResult:
    try:
        return SubmissionResult.model_validate_json(raw)
    except ValidationError as e:
        errors = []
        for err in e.errors(include_url=False):
            err = dict(err)
            err["loc"] = ("body", "result", *err["loc"])
            err.pop("ctx", None)
            errors.append(err)
        raise RequestValidationError(errors) from e


async def read_submission(
    request: Request, blobs: BlobStore, max_bytes: int
) -> tuple[SubmissionResult, dict[str, StagedBlob]]:
    """Parse the request into a validated result and its verified, staged files.

    Accepts ``multipart/form-data`` (a JSON part ``result`` and one file part per declared
    file) or, for metadata-only results, a plain ``application/json`` body.
    """
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise PayloadTooLargeError(max_bytes)
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        # Metadata only: held in memory, so bounded like a multipart field, not like an upload.
        limit = min(max_bytes, _MultipartForm.MAX_FIELD_BYTES)
        if length is not None and length.isdigit() and int(length) > limit:
            raise PayloadTooLargeError(limit)
        body = b"".join([c async for c in _limited(request, limit)])
        result = parse_result(body)
        if result.files:
            raise _validation_error(("files",), "declared files need a multipart upload")
        return result, {}

    form = _MultipartForm(content_type, blobs, max_bytes)
    try:
        await form.read(_limited(request, max_bytes))
        raw = form.fields.get("result")
        if raw is None:
            raise _validation_error(("result",), "missing JSON part 'result'", "missing")
        result = parse_result(raw)
        for name in form.files:
            if name not in result.files:
                raise _validation_error((name,), f"file part {name!r} not declared in result.files")
        for name in result.files:
            if name not in form.files:
                raise _validation_error(("files", name), f"declared file {name!r} has no part")
        for name, blob in form.files.items():
            if blob.sha256 != result.files[name]:
                raise BadSubmissionError(
                    f"files.{name}: sha256 mismatch (declared {result.files[name]}, "
                    f"received {blob.sha256})"
                )
        return result, form.files
    except BaseException:
        await run_in_threadpool(form.discard)
        raise


class _MultipartForm:
    """Streams a multipart body: small fields into memory, each file part straight into a
    staging file of the blob store, hashed on the way (python-multipart's push parser).

    One disk write per byte and nothing spooled to the container's /tmp (Starlette's form
    parser would spool each file there first); data is written from a thread in batches so
    the event loop never blocks on disk.
    """

    MAX_FIELD_BYTES = 1 << 20
    MAX_PARTS = 256
    BATCH_BYTES = 1 << 20

    def __init__(self, content_type: str, blobs: BlobStore, max_bytes: int):
        _, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if not boundary:
            raise _validation_error((), "multipart body without a boundary")
        self.blobs, self.max_bytes = blobs, max_bytes
        self.fields: dict[str, bytes] = {}
        self.files: dict[str, StagedBlob] = {}
        self._writers: dict[str, StagingWriter] = {}
        self._pending: list[tuple[StagingWriter, bytes]] = []
        self._pending_bytes = 0
        self._finished: list[str] = []
        self._parts = 0
        self._headers: dict[bytes, bytes] = {}
        self._hname = b""
        self._hvalue = b""
        self._name: str | None = None
        self._writer: StagingWriter | None = None
        self._field: bytearray | None = None
        self._error: Exception | None = None
        callbacks: Any = {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }
        self._parser = MultipartParser(boundary, callbacks)

    async def read(self, chunks: AsyncGenerator[bytes, None]) -> None:
        async for chunk in chunks:
            try:
                self._parser.write(chunk)
            except MultipartParseError as e:
                raise _validation_error((), f"bad multipart body: {e}") from e
            if self._error is not None:
                raise self._error
            if self._pending_bytes >= self.BATCH_BYTES or self._finished:
                await run_in_threadpool(self._flush)
        self._parser.finalize()
        if self._error is not None:
            raise self._error
        await run_in_threadpool(self._flush)
        if self._writers:
            raise _validation_error((), "multipart body ended inside a part")

    def discard(self) -> None:
        # Neither raises (a full disk included), so every temp file goes.
        self._pending.clear()
        for w in self._writers.values():
            w.abort()
        self._writers.clear()
        for blob in self.files.values():
            blob.discard()

    # Runs in a worker thread.
    def _flush(self) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        for writer, data in pending:
            writer.write(data)
        finished, self._finished = self._finished, []
        for name in finished:
            self.files[name] = self._writers.pop(name).finish()

    # Parser callbacks (synchronous, on the event loop: no bulk I/O here).
    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > self.MAX_PARTS:
            self._fail(_validation_error((), f"more than {self.MAX_PARTS} parts"))
        self._headers, self._name, self._writer, self._field = {}, None, None, None

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._hname.lower()] = self._hvalue
        self._hname, self._hvalue = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        if not name:
            self._fail(_validation_error((), "a part without a Content-Disposition name"))
            return
        self._name = name.decode("utf-8", "replace")
        if self._name in self.fields or self._name in self.files or self._name in self._writers:
            self._fail(_validation_error((self._name,), f"part {self._name!r} sent twice"))
        elif b"filename" in options and self._name != "result":
            # Only opens an empty temp file; the request body limit bounds its size.
            try:
                self._writer = self.blobs.writer()
            except OSError as e:  # a full volume: StorageFullError, a retryable 503
                self._fail(e)
                return
            self._writers[self._name] = self._writer
        else:
            self._field = bytearray()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._error is not None:
            return
        if self._writer is not None:
            self._pending.append((self._writer, bytes(data[start:end])))
            self._pending_bytes += end - start
        elif self._field is not None:
            self._field += data[start:end]
            if len(self._field) > self.MAX_FIELD_BYTES:
                self._fail(_validation_error((self._name,), "field part larger than 1 MiB"))

    def _part_end(self) -> None:
        if self._error is not None or self._name is None:
            return
        if self._writer is not None:
            self._finished.append(self._name)
        elif self._field is not None:
            self.fields[self._name] = bytes(self._field)

    def _fail(self, error: Exception) -> None:
        # Raising inside a callback would surface as a parser error; keep the first one.
        self._error = self._error or error
        self._writer = self._field = None


class Updater:
    def __init__(self, store: LeaderboardStore, blobs: BlobStore, metrics: LeaderboardMetrics):
        self.store, self.blobs, self.metrics = store, blobs, metrics

    async def submit(
        self, experiment_id: str, result: SubmissionResult, staged: dict[str, StagedBlob]
    ) -> SubmissionResponse:
        """Store the files (if any), then decide atomically. Consumes ``staged``."""
        shas = sorted(set(result.files.values()))
        holder = new_id("u")
        held = False
        try:
            if staged:
                await hold_for_upload(self.store, holder, shas)
                held = True
                await run_in_threadpool(_commit_all, self.blobs, list(staged.values()))
            retry, answer = await self.store.insert(
                experiment_id,
                submission_id=result.submission_id,
                score=result.score,
                fields=_candidate_fields(result),
                shas=list(result.files.values()),
                parent_id=result.parent_id,
                generation=result.generation,
                algorithm=result.algorithm,
                pod_id=result.pod_id,
                env_steps=result.env_steps,
                batch_env_steps=result.batch_env_steps,
            )
        finally:
            for blob in staged.values():
                blob.discard()
            if held:
                await self.store.unhold_blobs(holder, shas)
        response = SubmissionResponse(duplicate=retry, **answer)
        self.metrics.record_submission(experiment_id, response)
        # Accepted results are the interesting events; rejects and retries are the bulk.
        (log.info if response.accepted and not retry else log.debug)(
            "submission",
            experiment=experiment_id,
            submission=result.submission_id,
            accepted=response.accepted,
            rank=response.rank,
            evicted=len(response.evicted),
            duplicate=retry,
        )
        return response


async def hold_for_upload(store: LeaderboardStore, holder: str, shas: list[str]) -> None:
    """Hold ``shas`` for an upload (the collector will not delete them until released), waiting
    a moment while the collector is deleting one of them; ``StoreBusyError`` (503) if it goes on."""
    for _ in range(100):
        if await store.hold_blobs(holder, shas, UPLOAD_HOLD_S):
            return
        await asyncio.sleep(0.05)
    raise StoreBusyError("blob store busy collecting; retry")


def _commit_all(blobs: BlobStore, staged: list[StagedBlob]) -> None:
    for blob in staged:
        blobs.commit(blob)


def _candidate_fields(r: SubmissionResult) -> dict[str, str]:
    return {
        "algorithm": r.algorithm,
        "hyperparameters": json.dumps(r.hyperparameters),
        "parent_id": r.parent_id or "",
        "generation": str(r.generation),
        "pod_id": r.pod_id,
        "submission_id": r.submission_id,
        "env_steps": str(r.env_steps),
        "trained_env_steps": "" if r.trained_env_steps is None else str(r.trained_env_steps),
        "score": repr(r.score),
        "eval_mean": repr(r.eval.mean),
        "eval_std": repr(r.eval.std),
        "eval_episodes": str(r.eval.episodes),
        "files": json.dumps(r.files),
        "file_shas": json.dumps(list(r.files.values())),
    }
