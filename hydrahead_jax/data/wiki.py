"""MediaWiki markup → plain text, and a reader for MediaWiki XML dumps.

Our own small cleaner (no mwparserfromhell / gensim): nested constructs ({{templates}}, {| tables |},
[[links [[inside]] captions]]) are removed with explicit stacks or innermost-first rewriting, because a
regular expression cannot balance nesting. Article prose, headings (as plain lines) and link labels
survive; templates, tables, references, comments, files, categories and reference-type sections go.
"""

from __future__ import annotations

import bz2
import html
import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator

_COMMENT = re.compile(r"<!--.*?(-->|\Z)", re.S)
_REF_SELF_CLOSING = re.compile(r"<ref\b[^>]*/\s*>", re.I)
_REF_BLOCK = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.I | re.S)
# Blocks whose content is not prose at all (formulas, galleries, code, tables in HTML).
_DROP_BLOCKS = re.compile(
    r"<(math|gallery|timeline|syntaxhighlight|source|score|imagemap|table|chem)\b[^>]*>.*?</\1\s*>", re.I | re.S
)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
# A link with no nested [[...]] inside; single [brackets] may occur in captions.
_INNER_LINK = re.compile(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]")
_EXT_LINK_LABELLED = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+\s+([^\]]*)\]")
_EXT_LINK_BARE = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*\]")
_HEADING = re.compile(r"^(={2,6})\s*(.*?)\s*\1\s*$", re.M)
_BOLD_ITALIC = re.compile(r"'{2,5}")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*", re.M)
# Namespaces whose links are not prose: media, categories, and interlanguage/interwiki prefixes.
_DROP_LINK_NS = re.compile(r"^\s*:?\s*(file|image|media|category|[a-z]{2,3}(-[a-z]+)?|wikt|wiktionary)\s*:", re.I)
_KEEP_LINK_NS = re.compile(r"^\s*:?\s*(wikipedia|wp|help|portal|w)\s*:", re.I)
_DROP_SECTIONS = {
    "references",
    "external links",
    "see also",
    "further reading",
    "notes",
    "bibliography",
    "sources",
    "footnotes",
    "citations",
    "notes and references",
}


def _strip_nested_braces(text: str) -> str:
    """Removes {{ ... }} templates and {| ... |} tables, both of which nest (also in each other)."""
    out: list[str] = []
    stack: list[str] = []  # open constructs: "{{" or "{|"
    i, n = 0, len(text)
    start = 0  # start of the pending run of kept text
    while i < n:
        two = text[i : i + 2]
        if two in ("{{", "{|"):
            if not stack:
                out.append(text[start:i])
            stack.append(two)
            i += 2
        elif stack and ((two == "}}" and stack[-1] == "{{") or (two == "|}" and stack[-1] == "{|")):
            stack.pop()
            i += 2
            if not stack:
                start = i
        else:
            i += 1
    if not stack:
        out.append(text[start:])
    # An unbalanced opener swallows the rest: wiki dumps of truncated pages do this, and the
    # alternative (keeping template guts as prose) is worse.
    return "".join(out)


def _rewrite_link(match: re.Match) -> str:
    body = match.group(1)
    target, _, label = body.partition("|")
    if _DROP_LINK_NS.match(target) and not _KEEP_LINK_NS.match(target):
        return ""
    if label:
        # [[a|b|c]] (only in odd pages) shows the last part.
        return label.rsplit("|", 1)[-1]
    return target.lstrip(":").split("#", 1)[0] if not target.startswith("#") else target[1:]


def _drop_reference_sections(text: str) -> str:
    """Removes 'References', 'See also', ... sections: after refs are gone they hold only link lists."""
    out, skipping_level = [], 0
    for line in text.split("\n"):
        m = _HEADING.match(line)
        if m:
            level = len(m.group(1))
            if skipping_level and level > skipping_level:
                continue
            skipping_level = 0
            if m.group(2).strip().lower() in _DROP_SECTIONS:
                skipping_level = level
                continue
        if not skipping_level:
            out.append(line)
    return "\n".join(out)


def clean_wiki_markup(text: str) -> str:
    """Plain text of one article's wikitext.

    Steps, in the order that makes each safe: comments, refs and non-prose blocks go first (they may
    contain braces or brackets); then templates/tables (balanced stack); then links innermost-first so a
    file caption's inner links resolve before the file link itself is dropped; then external links,
    quotes, headings (kept as their text on their own line), list markers, HTML tags and entities.
    """
    text = _COMMENT.sub("", text)
    text = _REF_SELF_CLOSING.sub("", text)
    text = _REF_BLOCK.sub("", text)
    text = _DROP_BLOCKS.sub("", text)
    text = _strip_nested_braces(text)
    while True:
        new = _INNER_LINK.sub(_rewrite_link, text)
        if new == text:
            break
        text = new
    text = _EXT_LINK_LABELLED.sub(r"\1", text)
    text = _EXT_LINK_BARE.sub("", text)
    text = _drop_reference_sections(text)
    text = _HEADING.sub(r"\2", text)
    text = _BOLD_ITALIC.sub("", text)
    text = _TAG.sub("", text)
    text = html.unescape(text).replace("\xa0", " ")
    text = _LIST_MARKER.sub("", text)
    lines = []
    for line in text.split("\n"):
        line = re.sub(r"[ \t]+", " ", line).strip()
        # Leftovers of stripped markup (lone pipes, brace/bracket fragments, magic words like __TOC__).
        if re.fullmatch(r"[|{}\[\]!\-=_]*|__[A-Z]+__", line) and line:
            continue
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    text = re.sub(r" ([,.;:])", r"\1", text)  # space left where a ref stood before punctuation
    text = re.sub(r"\(\s*[,;]?\s*\)", "", text)  # "()" left by a removed template
    return text.strip()


def iter_wiki_articles(bz2_bytes: bytes) -> Iterator[tuple[str, str]]:
    """Yields (title, cleaned text) for main-namespace, non-redirect pages of a bz2 XML dump."""
    data = bz2.decompress(bz2_bytes)
    for _, elem in ET.iterparse(io.BytesIO(data), events=("end",)):
        if not elem.tag.endswith("}page") and elem.tag != "page":
            continue
        ns = _child_text(elem, "ns")
        redirect = any(c.tag.rsplit("}", 1)[-1] == "redirect" for c in elem)
        raw = None
        for c in elem.iter():
            if c.tag.rsplit("}", 1)[-1] == "text":
                raw = c.text or ""
        title = _child_text(elem, "title") or ""
        elem.clear()
        if ns != "0" or redirect or not raw or raw.lstrip().lower().startswith("#redirect"):
            continue
        body = clean_wiki_markup(raw)
        if body:
            yield title, f"{title}\n\n{body}"


def _child_text(elem: ET.Element, name: str) -> str | None:
    for c in elem:
        if c.tag.rsplit("}", 1)[-1] == name:
            return c.text
    return None
