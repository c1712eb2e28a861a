"""Per-writer Ed25519 keys and the trust policy a reader holds (issue 22).

A writer signs each entry it stores with its private key (`writer_key_file`, made by `nkicache keygen`); the
entry's header names the key by its id, the first 16 bytes of the SHA-256 of the raw 32-byte public key (32 hex
digits). A reader with a trust policy (`trust_policy`) accepts only entries signed by a key the policy lists.

The policy is a TOML file of `[[writer]]` tables, one per trusted key:

    [[writer]]
    name = "ci"                                      # shown in logs and reports
    public_key = "base64 of the raw 32-byte key"     # as `nkicache keygen` prints it
    key_id = "32 hex digits"                         # optional; checked against public_key when given

What a signature covers is cachestore.signatures. `TrustPolicy` remembers the signatures it verified, so an
entry read again (pass after pass in one worker) is verified once.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import json
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from bridge.errors import NkiCacheError
from cachestore.signatures import key_id_of

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# cryptography and PyNaCl (~40 ms of imports) are loaded by the functions that make, load, sign or verify with a
# key, so that a process that uses no key never loads them.

# Signatures verified by this process, so a worker that hits the same entry in pass after pass verifies it once (an
# Ed25519 verify costs 50-120 us, about half a remote hit; bench/RESULTS.md `signature_overhead`).
VERIFIED_MEMO_SIZE = 65536


class TrustError(NkiCacheError):
    """A key or trust-policy file cannot be used; the message names the file and the cause."""


def public_raw(public: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class WriterKey(msgspec.Struct, frozen=True):
    """A writer's private key and its id."""

    private: Ed25519PrivateKey
    key_id: bytes

    def __repr__(self) -> str:
        return f"WriterKey(key_id={self.key_id.hex()})"  # never the private key

    @classmethod
    def generate(cls) -> WriterKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        private = Ed25519PrivateKey.generate()
        return cls(private, key_id_of(public_raw(private.public_key())))

    @property
    def key_id_hex(self) -> str:
        return self.key_id.hex()

    def public_base64(self) -> str:
        return base64.b64encode(public_raw(self.private.public_key())).decode()

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    def private_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def policy_entry(self, name: str) -> str:
        """This key's `[[writer]]` table for a trust policy file."""
        return policy_table(name, self.key_id, public_raw(self.private.public_key()))


def policy_table(name: str, key_id: bytes, public: bytes) -> str:
    """One `[[writer]]` table (a JSON string is a valid TOML basic string, so any name is quoted right)."""
    encoded = base64.b64encode(public).decode()
    return f'[[writer]]\nname = {json.dumps(name)}\nkey_id = "{key_id.hex()}"\npublic_key = "{encoded}"\n'


def write_writer_key(path: Path, name: str) -> WriterKey:
    """A new writer key: the private key at `path` (PEM, mode 0600, never overwritten) and its trust-policy
    table at `path`.pub."""
    key = WriterKey.generate()
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise TrustError(f"{path}: exists; a writer key is not overwritten (its entries lose their writer)") from None
    except OSError as exc:
        raise TrustError(f"{path}: cannot create the key file: {exc.strerror or exc}") from None
    with os.fdopen(descriptor, "wb") as out:
        out.write(key.private_pem())
    Path(f"{path}.pub").write_text(key.policy_entry(name))
    return key


def load_writer_key(path: str | Path) -> WriterKey:
    """The private key in `path`; refused when others may read or write the file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise TrustError(f"{path}: cannot read the writer key: {exc.strerror or exc}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        raise TrustError(f"{path}: the writer key is readable or writable by others (mode {mode & 0o777:o}); chmod 600")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise TrustError(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise TrustError(f"{path}: not an Ed25519 key")
    return WriterKey(private, key_id_of(public_raw(private.public_key())))


class TrustedWriter:
    """A key the policy trusts, under its name. It verifies through libsodium (PyNaCl): 76 us a verify here
    against 120-150 us through cryptography's OpenSSL (bench/RESULTS.md, issue 22), and a reader's first hits pay
    one. Keys are still made, stored and signed with by cryptography (PEM files); both implement RFC 8032,
    libsodium the stricter of the two (it refuses small-order keys and non-canonical signatures, which no honest
    writer produces)."""

    __slots__ = ("_verifier", "key_id", "name", "public")

    def __init__(self, name: str, key_id: bytes, public: Ed25519PublicKey) -> None:
        from nacl.signing import VerifyKey

        self.name, self.key_id, self.public = name, key_id, public
        self._verifier = VerifyKey(public_raw(public))

    def __repr__(self) -> str:
        return f"TrustedWriter(name={self.name!r}, key_id={self.key_id.hex()})"

    def signed(self, signature: bytes, message: bytes) -> bool:
        """Whether `signature` is this writer's Ed25519 signature of `message`."""
        from nacl.exceptions import BadSignatureError

        try:
            self._verifier.verify(message, signature)
        except (BadSignatureError, ValueError, TypeError):  # a forgery; a signature of the wrong length or type
            return False
        return True


class TrustPolicy:
    """The writers a reader accepts entries from, by key id."""

    def __init__(self, writers: list[TrustedWriter], source: str = "trust policy"):
        self.source = source
        self.writers = {writer.key_id: writer for writer in writers}
        self._verified: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.verifies = 0  # Ed25519 verifies this policy ran (the memo answers the others): `nkicache bench`

    def adding(self, writer: WriterKey, name: str) -> TrustPolicy:
        """This policy, trusting `writer` too."""
        added = TrustedWriter(name, writer.key_id, writer.private.public_key())
        return TrustPolicy([*self.writers.values(), added], self.source)

    def trusts(self, key_id: bytes) -> bool:
        return key_id in self.writers

    def name_of(self, key_id: bytes) -> str:
        writer = self.writers.get(key_id)
        return writer.name if writer else ""

    def check(self, key_id: bytes, message: bytes, signature: bytes) -> str | None:
        """None when `signature` over `message` verifies with the trusted key `key_id`, else why not."""
        writer = self.writers.get(key_id)
        if writer is None:
            return f"signed by writer {key_id.hex()}, which the trust policy does not trust"
        memo = hashlib.sha256(key_id + signature + message).digest()
        with self._lock:
            if memo in self._verified:
                self._verified.move_to_end(memo)
                return None
            self.verifies += 1
        if not writer.signed(signature, message):
            return f"signature of writer {key_id.hex()} ({writer.name}) does not verify"
        with self._lock:
            self._verified[memo] = None
            if len(self._verified) > VERIFIED_MEMO_SIZE:
                self._verified.popitem(last=False)
        return None


def load_trust_policy(path: str | Path) -> TrustPolicy:
    """The policy in the TOML file `path`; any malformed table is an error naming the file and the table."""
    import tomllib

    path = Path(path)
    try:
        document = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise TrustError(f"{path}: cannot read the trust policy: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TrustError(f"{path}: the trust policy is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise TrustError(f"{path}: the trust policy is not valid TOML: {exc}") from None
    unknown = set(document) - {"writer"}
    if unknown:
        raise TrustError(f"{path}: unknown trust policy key {sorted(unknown)[0]!r} (only [[writer]] tables)")
    tables = document.get("writer", [])
    if not isinstance(tables, list):
        raise TrustError(f"{path}: 'writer' must be [[writer]] tables")
    return TrustPolicy([_writer(path, number, table) for number, table in enumerate(tables, 1)], str(path))


def _writer(path: Path, number: int, table: object) -> TrustedWriter:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    where = f"{path}: writer {number}"
    if not isinstance(table, dict) or set(table) - {"name", "public_key", "key_id"}:
        raise TrustError(f"{where}: a [[writer]] table holds name, public_key and key_id only")
    name, encoded = table.get("name", ""), table.get("public_key")
    if not isinstance(name, str) or not isinstance(encoded, str):
        raise TrustError(f"{where}: name and public_key must be strings")
    try:
        raw = base64.b64decode(encoded, validate=True)
        public = Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError):
        raise TrustError(f"{where}: public_key is not the base64 of a raw 32-byte Ed25519 key") from None
    key_id = key_id_of(raw)
    if "key_id" in table and table["key_id"] != key_id.hex():
        raise TrustError(f"{where}: key_id {table['key_id']!r} is not the id of its public_key ({key_id.hex()})")
    return TrustedWriter(name, key_id, public)


def without_writer(path: str | Path, key_id_hex: str) -> int:
    """Remove every [[writer]] table of `key_id_hex` from the policy file (rewritten in place); how many."""
    policy = load_trust_policy(path)
    kept = [w for w in policy.writers.values() if w.key_id.hex() != key_id_hex.lower()]
    removed = len(policy.writers) - len(kept)
    if removed:
        text = "\n".join(policy_table(w.name, w.key_id, public_raw(w.public)) for w in kept)
        temporary = Path(f"{path}.tmp")
        temporary.write_text(text)
        os.replace(temporary, path)
    return removed
