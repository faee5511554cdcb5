"""The profile store's domain core: validation, the database, and the cache in front of gets."""

from __future__ import annotations

from typing import Protocol

from gpuloom.domain.errors import InvalidArgument, NotFound
from gpuloom.domain.profiles import (
    Page,
    Profile,
    ProfileFilter,
    ProfileId,
    ProfileKind,
    profile_id,
)
from gpuloom.domain.validation import (
    check_gpu_model,
    check_key,
    check_version,
    validate_profile,
)
from gpuloom.services.profile_store.cache import ProfileCache
from gpuloom.services.profile_store.repository import MAX_PAGE_SIZE, ProfileRepository


class ProfileCodec(Protocol):
    """How profiles are encoded in the cache. The servicer supplies its wire encoding, so a cache
    hit is served as stored bytes without building a Python object per kernel."""

    def encode(self, profile: Profile) -> bytes: ...

    def decode(self, kind: ProfileKind, data: bytes) -> Profile: ...


class ProfileStore:
    def __init__(
        self, repository: ProfileRepository, cache: ProfileCache, codec: ProfileCodec
    ) -> None:
        self._repository = repository
        self._cache = cache
        self._codec = codec

    async def get_encoded(self, pid: ProfileId) -> bytes:
        """The profile in the codec's encoding: from the cache, else from the database."""
        check_key("key", pid.key)
        check_gpu_model("gpu_model", pid.gpu_model)
        entry = await self._cache.fetch(pid)
        if entry is not None:
            if entry.payload is None:
                raise NotFound(f"no {pid}")
            return entry.payload
        found = await self._repository.lookup(pid)
        payload = self._codec.encode(found.profile) if found.profile is not None else None
        if found.version:
            await self._cache.offer(pid, found.version, payload)
        if payload is None:
            raise NotFound(f"no {pid}")
        return payload

    async def get(self, pid: ProfileId) -> Profile:
        return self._codec.decode(pid.kind, await self.get_encoded(pid))

    async def put(self, profile: Profile, expected_version: int | None = None) -> Profile:
        validate_profile(profile)
        check_version("expected_version", expected_version)
        stored = await self._repository.put(profile, expected_version)
        await self._cache.offer(profile_id(stored), stored.version, self._codec.encode(stored))
        return stored

    async def delete(self, pid: ProfileId, expected_version: int | None = None) -> int:
        check_key("key", pid.key)
        check_gpu_model("gpu_model", pid.gpu_model)
        check_version("expected_version", expected_version)
        version = await self._repository.delete(pid, expected_version)
        await self._cache.offer(pid, version, None)
        return version

    async def list(self, where: ProfileFilter, page_size: int = 0, page_token: str = "") -> Page:
        if where.key:
            check_key("key", where.key)
        if where.gpu_model:
            check_gpu_model("gpu_model", where.gpu_model)
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument(
                "page_size", f"must be within 0..{MAX_PAGE_SIZE}, got {page_size}"
            )
        return await self._repository.list(where, page_size, page_token)
