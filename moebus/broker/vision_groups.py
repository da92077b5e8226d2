"""The choices of one request share one encode of its images. A chat completion with ``n`` choices
is n broker requests (one per choice, each its own sampling seed) carrying the same image files;
the api marks them with one ``image_group`` and its size. The first to arrive leads: it waits and
encodes as any image request does; the others follow it, and take its embeddings when they come
(or, arriving later, from the group, which stays open until all ``image_group_size`` came in).
A follower shares its leader's fate: the leader's error is its error too (the api fails the whole
completion on any choice's error anyway), and a member arriving after it failed gets it as well; a
cancelled leader hands its place, and its encode in flight, to its first follower.

A group is keyed by the client and its name, and a member's image files must hash to the
leader's: a request never takes embeddings of images it did not send."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

GROUP_TTL_S = 60.0  # a finished group whose last members never come (failed in admission) is dropped then
# Finished groups held for their late members, at most: each holds its embeddings (MBs of float32
# per image on a real tower) in the broker, and a client that sends n > 1 groups whose other members
# never come must not make the broker hold every one for GROUP_TTL_S. The oldest made goes first; a
# member arriving after its group went leads a group of its own (it encodes again).
MAX_DONE_GROUPS = 32


def image_keys(images: list[np.ndarray]) -> list[bytes]:
    """The images' SHA-256 digests (computed on the tokenizer threads, not the loop)."""
    return [hashlib.sha256(memoryview(np.ascontiguousarray(image)).cast("B")).digest() for image in images]


@dataclass
class ImageGroup:
    keys: list[bytes]  # the leader's images: a member must carry the same
    remaining: int  # members (the leader included) that have not taken the embeddings yet
    leader: object  # the ImageRequest that encodes for the group
    followers: list = field(default_factory=list)  # ImageRequests waiting for the leader's embeddings
    embeds: np.ndarray | None = None  # once encoded: read-only, shared by every member's Sequence
    error: dict | None = None  # once the leader failed: the fields of every member's ERROR
    expires_s: float = float("inf")

    @property
    def is_done(self) -> bool:
        return self.embeds is not None or self.error is not None


class ImageGroups:
    def __init__(self):
        self.groups: dict[tuple[bytes, str], ImageGroup] = {}

    @staticmethod
    def _key(req) -> tuple[bytes, str] | None:
        return (req.seq.client, req.group) if req.group is not None and req.group_size > 1 else None

    def join(self, req) -> ImageGroup | None:
        """The open group that ``req`` belongs to, None when it leads one (or has none). A member
        whose images differ from the leader's is on its own, and so is one beyond the group's size
        (followers wait outside the lifecycle's bounded queue: a group must not grow past its size)."""
        key = self._key(req)
        group = self.groups.get(key) if key is not None else None
        if group is None:
            if key is not None:
                self.groups[key] = ImageGroup(req.keys, req.group_size, req)
            return None
        if group.keys != req.keys or (not group.is_done and len(group.followers) + 1 >= group.remaining):
            return None
        if not group.is_done:
            group.followers.append(req)
        return group

    def take(self, group: ImageGroup) -> None:
        """A late member took the group's embeddings, or its error."""
        self._taken(group, 1)

    def encoded(self, leader, embeds: np.ndarray) -> list:
        """The leader's embeddings are in: the followers that were waiting for them."""
        group = self._led_by(leader)
        if group is None or group.is_done:
            return []
        embeds.flags.writeable = False  # several sequences hold it
        group.embeds = embeds
        return self._done(group)

    def failed(self, leader, error: dict) -> list:
        """The leader failed before its embeddings came (``error``: its ERROR's fields): its
        followers, which fail with it; later members will too."""
        group = self._led_by(leader)
        if group is None or group.is_done:
            return []
        group.error = error
        return self._done(group)

    def cancelled(self, req):
        """``req`` is cancelled while it waits: its follower that takes its place as the leader
        (None: there is none, or ``req`` did not lead)."""
        key = self._key(req)
        group = self.groups.get(key) if key is not None else None
        if group is None or group.is_done:
            return None
        if req in group.followers:
            group.followers.remove(req)
            group.remaining -= 1
            return None
        if group.leader is not req:
            return None
        group.remaining -= 1
        if not group.followers:
            del self.groups[key]
            return None
        group.leader = group.followers.pop(0)
        return group.leader

    def followers(self) -> list:
        return [f for group in self.groups.values() for f in group.followers]

    def expire(self, now: float) -> None:
        for key in [k for k, g in self.groups.items() if g.expires_s < now]:
            del self.groups[key]

    def _led_by(self, leader) -> ImageGroup | None:
        key = self._key(leader)
        group = self.groups.get(key) if key is not None else None
        return group if group is not None and group.leader is leader else None

    def _done(self, group: ImageGroup) -> list:
        followers, group.followers = group.followers, []
        group.expires_s = time.monotonic() + GROUP_TTL_S
        self._taken(group, 1 + len(followers))
        done = [k for k, g in self.groups.items() if g.is_done]  # oldest (first made) first
        for key in done[:max(0, len(done) - MAX_DONE_GROUPS)]:
            del self.groups[key]
        return followers

    def _taken(self, group: ImageGroup, n: int) -> None:
        group.remaining -= n
        if group.remaining <= 0:
            del self.groups[self._key(group.leader)]
