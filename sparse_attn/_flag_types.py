"""The command line's flag types: argparse ``type=`` converters shared by
every subcommand (``sparse-attn bench``, ``bench kernels``, ``bench model``,
``eval``).

A bad value ends the parse, before any work, with argparse's one line that
names the flag and exit status 2::

    sparse-attn bench: error: argument --heads: must be >= 1, got 0

rather than a traceback where the value is first used (after the memory
floor, a model load, or the whole run for an output path) or a run that
quietly does something else.  Every integer is also bounded by what a C
int holds, as the C core takes counts and sizes as C ints.  Rules that tie
two flags together (``--heads`` a multiple of ``--kv-heads``) belong to
each parser, checked with ``ap.error`` right after the parse.
"""
import argparse
import os

from ._checks import INT_MAX
from .errors import ArgumentError
from .isa import default_threads

Invalid = argparse.ArgumentTypeError


def int_in(minimum, maximum=INT_MAX):
    """A converter to an int in [minimum, maximum]."""
    def integer(text):
        try:
            value = int(text)
        except ValueError:
            raise Invalid(f"must be an integer, got {text!r}") from None
        if value < minimum and maximum == INT_MAX:
            raise Invalid(f"must be >= {minimum}, got {value}")
        if not minimum <= value <= maximum:
            held = " (a C int)" if maximum == INT_MAX else ""
            raise Invalid(f"must be in [{minimum}, {maximum}]{held}, got {value}")
        return value
    return integer


positive_int = int_in(1)
non_negative_int = int_in(0)


def float_in(minimum, maximum):
    """A converter to a float in [minimum, maximum] (NaN is not in it)."""
    def real(text):
        try:
            value = float(text)
        except ValueError:
            raise Invalid(f"must be a number, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise Invalid(f"must be in [{minimum:g}, {maximum:g}], got {text.strip()}")
        return value
    return real


def one_of(*choices):
    """A converter that takes one of the strings `choices`."""
    def choice(text):
        if text not in choices:
            raise Invalid(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    return choice


def checked(parse):
    """`parse` (text -> value, raising ValueError, as the package's
    ArgumentError is one) as a converter whose errors become the flag's
    line."""
    def convert(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise Invalid(str(exc)) from None
    return convert


def list_of(item, sep=",", skip_blank=False):
    """A converter to a list of `item` values separated by `sep`, at least
    one.  A blank item is refused (``2061,`` is a typo more often than a
    wish), or with `skip_blank` dropped: a ';'-list of policies or
    configurations may end on a ';'."""
    def values(text):
        parts = [p.strip() for p in text.split(sep)]
        if skip_blank:
            parts = [p for p in parts if p]
        elif "" in parts and parts != [""]:
            raise Invalid(f"a blank item in {text!r}")
        if not [p for p in parts if p]:
            raise Invalid(f"expected at least one value ('{sep}'-separated), got {text!r}")
        return [item(p) for p in parts]
    return values


def none_or(convert):
    """`convert`, or the word ``none`` for an empty list."""
    def value(text):
        return [] if text.strip() == "none" else convert(text)
    return value


def output_file(text):
    """A file path the command writes, maybe only at the end of its run:
    what would stop the write (no such folder, a folder given, no write
    permission) is refused now."""
    if not text:
        raise Invalid("expected a file path, got ''")
    if os.path.isdir(text):
        raise Invalid(f"{text} is a folder: give a file path")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise Invalid(f"cannot write {text}: there is no folder {folder}")
    writable = os.access(text, os.W_OK) if os.path.exists(text) else \
        os.access(folder, os.W_OK | os.X_OK)
    if not writable:
        raise Invalid(f"cannot write {text}: permission denied")
    return text


def output_folder(text):
    """A folder the command saves into, made with its parents if missing:
    refused now if it is a file, lies under one, or cannot be written."""
    if not text:
        raise Invalid("expected a folder path, got ''")
    path = os.path.abspath(text)
    nearest = path
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        raise Invalid(f"cannot save into {text}: {nearest} is a file, not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise Invalid(f"cannot save into {text}: {nearest} is not writable")
    return text


def model_folder(text):
    """A local model folder (nothing is downloaded)."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise Invalid(f"{text} is a file: give the model's folder")
    if not os.path.isdir(text):
        raise Invalid(f"no folder {text!r} (a local model folder: nothing is downloaded)")
    return text


def check_model_files(ap, args):
    """--gguf names a file inside --model: both given, and the file there."""
    if args.gguf is None:
        return
    if args.model is None:
        ap.error("--gguf names a file inside --model: give --model too")
    if not os.path.isfile(os.path.join(args.model, args.gguf)):
        ap.error(f"--gguf: no file {args.gguf!r} in --model {args.model}")


def threads_default(ap):
    """What --threads defaults to (SPARSE_ATTN_NUM_THREADS or the usable
    cores), its environment variable checked with the flags."""
    try:
        return default_threads()
    except ArgumentError as exc:
        ap.error(str(exc))


def fill_defaults(args, defaults, quick):
    """Each flag of `defaults` the command line left unset (None) takes its
    --quick value when args.quick, else its default: flags given
    explicitly keep their value either way."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick[name] if args.quick else value)
