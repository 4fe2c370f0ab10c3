"""Synthetic but document-like texts for the RAG benchmarks: Markdown reports with headings and paragraphs.

Deterministic for a seed. Every document is about its own company (names, years, figures and sentence choices
drawn from the seed), so documents share wording but not content, as a real corpus of similar reports would.
"""

from __future__ import annotations

import random
from collections.abc import Callable

_COMPANIES = ("Halden", "Morrow", "Kestrel", "Varga", "Ostrand", "Pellam", "Quillon", "Ruskin", "Tamsin", "Welde")
_SECTIONS = ("Overview", "History", "Operations", "Products", "Research", "Finances", "Risks", "Outlook", "People")
_CITIES = ("Lisbon", "Osaka", "Toronto", "Nairobi", "Oslo", "Lima", "Perth", "Seville", "Tallinn", "Quito")
_PRODUCTS = ("spectrometer", "gimbal", "thermal camera", "flow meter", "laser level", "seismograph", "hygrometer")
_TEAMS = ("optics", "firmware", "logistics", "robotics", "acoustics", "materials", "sensors", "telemetry")
_SENTENCES = (
    "In {year}, the {team} team opened an office in {city} and hired {count} engineers.",
    "Revenue from the {product} grew by {percent} percent over the year, mostly from customers in {city}.",
    "The board approved a budget of {count} million euros for the {team} group's work on the {product}.",
    "Field tests of the {product} near {city} found a calibration drift of {percent} parts per thousand.",
    "Since {year}, every {product} has been assembled in {city}, where the {team} team also runs its lab.",
    "Customer complaints about the {product} fell by {percent} percent after the {team} team's redesign.",
    "The company expects the {team} team to double by {year}, with most new hires based in {city}.",
    "A supplier dispute in {year} delayed shipments of the {product} by {count} days.",
)


def synthetic_document(seed: int, count_tokens: Callable[[str], int], target_tokens: int) -> str:
    """A report of at least `target_tokens` tokens (as `count_tokens` counts them): a title, then sections of
    a heading and two to four paragraphs of three to six sentences."""
    rng = random.Random(seed)
    company = f"{rng.choice(_COMPANIES)} {rng.choice(('Instruments', 'Systems', 'Labs', 'Works'))} {seed}"
    blocks = [f"# {company}: annual report"]
    tokens = count_tokens(blocks[0])
    while tokens < target_tokens:
        section = [f"## {rng.choice(_SECTIONS)}"]
        for _ in range(rng.randint(2, 4)):
            section.append(" ".join(_sentence(rng) for _ in range(rng.randint(3, 6))))
        text = "\n\n".join(section)
        blocks.append(text)
        tokens += count_tokens(text)
    return "\n\n".join(blocks)


def changed_document(text: str, seed: int) -> str:
    """The document with one sentence added at the end, as an edited version of it would be."""
    return f"{text} {_sentence(random.Random(seed))}"


def _sentence(rng: random.Random) -> str:
    return rng.choice(_SENTENCES).format(
        year=rng.randint(1950, 2030), team=rng.choice(_TEAMS), city=rng.choice(_CITIES),
        product=rng.choice(_PRODUCTS), count=rng.randint(3, 400), percent=rng.randint(2, 60),
    )
