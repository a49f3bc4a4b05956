"""Synthetic function-calling questions: everyday computations and lookups, leakage-free.

The second generator next to :mod:`~morse_jax.tasks.bfcl.synthetic`. That one invents domains
(beekeeping, lighthouse logs) and phrases every request as an order with one clause per call; a
model trained on it handed about half of BFCL's irrelevance items to the executor and wrote one
call where a parallel item wants several (README, "MoRAgent on BFCL"). Here the requests are
*questions* about the kind of things a function-calling user asks (geometry, physics, money,
statistics, unit conversions, weather, travel, food, sports, books), and the two decisions those
rows got wrong are taught directly:

* **call or not**: an ``irrelevance`` request is a question another tool of the catalogue would
  answer, or a general-knowledge question no tool answers, offered 1-3 tools of *other* topics
  (each tool has its own topic, so no offered tool can serve it); the reference is no call;
* **how many calls**: a ``parallel`` request names several values of one argument in one question
  ("... for Lisbon, Oslo and Quito") or repeats the argument phrase ("..., and also with ...");
  its reference is one call per value.

Function names are this module's own (checked against every BFCL category by the test suite, as
are the requests' 8-word phrases), parameter schemas use BFCL's dialect (``"type": "dict"``,
required and optional parameters, optional ones with a ``default`` that requests may leave out).
Records have :mod:`~morse_jax.tasks.bfcl.synthetic`'s format and scenarios and go through the same
converter (:func:`~morse_jax.tasks.bfcl.trajectories.from_function_calling`).

The module is longer than 400 lines because most of it is the catalogue, a table of 36 tools.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from morse_jax.tasks.bfcl.synthetic import PYTHON_HINT, distinct_records

DEFAULT_MIX = {"simple": 0.25, "multiple": 0.2, "parallel": 0.2, "parallel_multiple": 0.1, "irrelevance": 0.25}


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter: schema type, description, candidate values and phrasings (each with "{v}")."""

    name: str
    type: str  # integer | float | string | boolean | array (items typed after ``values``)
    description: str
    values: tuple
    phrases: tuple[str, ...]
    enum: bool = False  # the schema lists ``values`` as its enum
    default: Any = None  # None: required; else optional with this default

    def schema(self) -> dict:
        entry: dict[str, Any] = {"type": self.type, "description": self.description}
        if self.type == "array":
            kinds = {type(v) for v in self.values}
            entry["items"] = {"type": {int: "integer", float: "float"}.get(kinds.pop(), "string") if len(kinds) == 1
                              else "string"}
        if self.enum:
            entry["enum"] = list(self.values)
        if self.default is not None:
            entry["description"] += f" Default: {self.default!r}."
            entry["default"] = self.default
        return entry


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function of the catalogue: ``asks`` are question templates holding "{args}" (the argument
    phrases). Each tool is a topic of its own (no other tool answers its questions), which is what
    makes an irrelevance record's offered tools unable to serve its question."""

    name: str
    description: str
    params: tuple[Param, ...]
    asks: tuple[str, ...]

    def schema(self) -> dict:
        return {"name": self.name, "description": self.description + PYTHON_HINT,
                "parameters": {"type": "dict", "properties": {p.name: p.schema() for p in self.params},
                               "required": [p.name for p in self.params if p.default is None]}}


def _ints(lo: int, hi: int, step: int = 1) -> tuple:
    return tuple(range(lo, hi + 1, step))


CITIES = ("Lisbon", "Oslo", "Quito", "Hanoi", "Nairobi", "Montevideo", "Tallinn", "Perth", "Valparaiso", "Krakow",
          "Accra", "Halifax", "Bergen", "Cusco", "Porto", "Ljubljana")
COUNTRIES = ("Portugal", "Norway", "Ecuador", "Vietnam", "Kenya", "Uruguay", "Estonia", "Chile", "Ghana", "Slovenia")
TEAMS = ("Riverside Hawks", "Northgate Rovers", "Harbor City Owls", "Eastfield Comets", "Lakeshore Foxes",
         "Summit Bears")
AUTHORS = ("Mira Castell", "Jonah Beck", "Ada Okafor", "Lena Voss", "Tomas Ruiz", "Priya Natarajan")
CUISINES = ("Ethiopian", "Peruvian", "Georgian", "Malaysian", "Lebanese", "Basque")
INGREDIENTS = ("chickpeas", "lentils", "eggplant", "salmon", "buckwheat", "pumpkin", "tofu", "spinach")
GENRES = ("jazz", "folk", "techno", "opera", "blues")
TICKERS = ("NVLX", "QRTZ", "BLMN", "HRZN", "TKNO")
DATES = tuple(f"2027-{m:02d}-{d:02d}" for m in (2, 5, 8, 11) for d in (3, 14, 22))
UNITS_LEN = ("meters", "feet", "inches", "kilometers", "miles")
CURRENCIES = ("EUR", "JPY", "CAD", "CHF", "BRL", "INR")


def P(name, type_, description, values, *phrases, enum=False, default=None) -> Param:  # noqa: N802 (a table row)
    return Param(name, type_, description, tuple(values), tuple(phrases), enum, default)


# one topic per tool; names are this module's own (the test suite checks them against BFCL)
CATALOGUE: tuple[Tool, ...] = (
    # geometry
    Tool("shapes.cone_volume_of", "Volume of a right circular cone.",
         (P("radius", "float", "Base radius.", (1.5, 2.0, 3.0, 4.5, 6.0, 7.5), "a base radius of {v}", "radius {v}"),
          P("height", "float", "Height of the cone.", (2.0, 5.0, 8.0, 12.5), "a height of {v}", "height {v}")),
         ("How big is a cone with {args}, by volume?", "Work out how much a cone with {args} holds.")),
    Tool("shapes.trapezium_area", "Area of a trapezium from its two parallel sides and height.",
         (P("side_a", "integer", "First parallel side.", _ints(3, 30), "one parallel side of {v}"),
          P("side_b", "integer", "Second parallel side.", _ints(3, 30), "the other of {v}"),
          P("height", "integer", "Distance between the parallel sides.", _ints(2, 20), "a height of {v}")),
         ("What area does a trapezium with {args} have?", "Give me the area of a trapezium with {args}.")),
    Tool("shapes.regular_polygon_perimeter", "Perimeter of a regular polygon.",
         (P("sides", "integer", "Number of sides.", _ints(3, 12), "{v} sides"),
          P("side_length", "float", "Length of one side.", (1.5, 2.5, 4.0, 9.0), "sides of length {v}",
            "each side {v} long")),
         ("What is the perimeter of a regular polygon with {args}?", "Perimeter of a regular polygon with {args}?")),
    Tool("shapes.sphere_surface", "Surface area of a sphere.",
         (P("radius", "float", "Radius of the sphere.", (0.5, 1.2, 3.0, 6.4, 10.0), "a radius of {v}", "radius {v}"),
          P("unit", "string", "Length unit of the radius.", ("cm", "m", "in"), "measured in {v}", default="m")),
         ("How much surface does a sphere with {args} have?", "Find the surface area for a sphere with {args}.")),
    Tool("shapes.hypotenuse_length", "Hypotenuse of a right triangle from its two legs.",
         (P("leg_a", "float", "First leg.", (3.0, 5.0, 6.5, 8.0, 9.0), "one leg of {v}", "a first leg {v}"),
          P("leg_b", "float", "Second leg.", (4.0, 12.0, 7.5, 15.0), "another of {v}", "a second leg {v}")),
         ("How long is the hypotenuse of a right triangle with {args}?", "Hypotenuse for legs: {args}?")),
    # physics
    Tool("mechanics.kinetic_energy_of", "Kinetic energy of a moving body in joules.",
         (P("mass_kg", "float", "Mass in kilograms.", (0.5, 2.0, 70.0, 1200.0), "a mass of {v} kg", "{v} kg"),
          P("speed_mps", "float", "Speed in metres per second.", (3.0, 12.5, 30.0, 250.0), "moving at {v} m/s",
            "a speed of {v} m/s")),
         ("How much kinetic energy does a body with {args} carry?", "Kinetic energy for a body with {args}?")),
    Tool("mechanics.free_fall_time", "Time for an object to fall from rest through a height.",
         (P("drop_height_m", "float", "Height in metres.", (5.0, 20.0, 45.0, 120.0), "from {v} m", "a {v} m drop"),
          P("gravity", "float", "Gravitational acceleration in m/s^2.", (1.62, 3.71, 24.79), "with gravity {v}",
            default=9.81)),
         ("How long does a stone take to fall {args}?", "Time to hit the ground {args}?")),
    Tool("circuits.ohms_law_current", "Current through a resistor from voltage and resistance.",
         (P("voltage", "float", "Voltage in volts.", (1.5, 5.0, 12.0, 230.0), "{v} volts", "a voltage of {v} V"),
          P("resistance", "float", "Resistance in ohms.", (10.0, 47.0, 220.0, 1000.0), "{v} ohms",
            "a resistance of {v} ohms")),
         ("What current flows with {args}?", "Current through a resistor with {args}, please.")),
    Tool("optics.lens_image_distance", "Image distance of a thin lens from focal length and object distance.",
         (P("focal_cm", "float", "Focal length in centimetres.", (5.0, 10.0, 15.0, 25.0), "focal length {v} cm"),
          P("object_cm", "float", "Object distance in centimetres.", (20.0, 30.0, 60.0), "an object {v} cm away")),
         ("Where does a thin lens form the image, with {args}?", "Image distance for a lens with {args}?")),
    Tool("thermo.heat_to_warm", "Heat needed to warm a mass of a substance.",
         (P("mass_g", "float", "Mass in grams.", (50.0, 250.0, 500.0, 1000.0), "{v} g", "a mass of {v} grams"),
          P("delta_c", "float", "Temperature rise in degrees Celsius.", (5.0, 20.0, 65.0), "by {v} degrees"),
          P("substance", "string", "Substance being heated.", ("water", "iron", "copper", "olive oil"), "of {v}",
            default="water")),
         ("How much heat warms {args}?", "Energy to heat {args}?")),
    # money
    Tool("money.loan_installment", "Fixed monthly installment of an amortised loan.",
         (P("principal", "integer", "Amount borrowed.", (5000, 12000, 250000, 400000), "{v} borrowed",
            "a principal of {v}"),
          P("annual_rate", "float", "Yearly interest rate as a fraction.", (0.029, 0.045, 0.061), "at a rate of {v}",
            "with yearly interest {v}"),
          P("months", "integer", "Number of monthly payments.", (24, 60, 180, 360), "over {v} months")),
         ("What would I pay each month for a loan with {args}?", "Monthly installment of a loan with {args}?")),
    Tool("money.compound_growth", "Value of a deposit after compound interest.",
         (P("deposit", "float", "Initial deposit.", (1000.0, 2500.0, 10000.0), "a deposit of {v}", "{v} deposited"),
          P("rate", "float", "Yearly rate as a fraction.", (0.02, 0.035, 0.07), "growing at {v} a year"),
          P("years", "integer", "Years invested.", _ints(2, 30), "for {v} years", "after {v} years"),
          P("times_per_year", "integer", "Compounding periods per year.", (4, 12), "compounded {v} times a year",
            default=1)),
         ("How much is {args} worth?", "What does {args} grow to?")),
    Tool("money.exchange_amount", "Converts an amount between currencies at today's rate.",
         (P("amount", "float", "Amount to convert.", (20.0, 150.0, 999.0, 5000.0), "{v}"),
          P("from_currency", "string", "ISO code of the source currency.", CURRENCIES, "from {v}", "of {v}"),
          P("to_currency", "string", "ISO code of the target currency.", ("USD", "GBP", "AUD", "SEK"), "into {v}",
            "to {v}")),
         ("How much is {args}?", "Convert {args}, please.")),
    Tool("money.tip_split", "Each person's share of a bill with a tip.",
         (P("bill", "float", "Bill total.", (48.5, 86.0, 132.4, 310.0), "a bill of {v}", "a {v} bill"),
          P("people", "integer", "People sharing.", _ints(2, 9), "between {v} people", "split {v} ways"),
          P("tip_percent", "integer", "Tip in percent.", (10, 15, 18, 20), "with a {v} percent tip", default=15)),
         ("What does each of us pay for {args}?", "Share per person of {args}?")),
    Tool("markets.share_quote", "Latest trading price of a listed share.",
         (P("ticker", "string", "Ticker symbol.", TICKERS, "{v}", "the {v} shares"),
          P("exchange", "string", "Stock exchange.", ("NASDAQ", "LSE", "TSX"), "on {v}", default="NASDAQ")),
         ("What is the latest price of {args}?", "Quote me {args}.")),
    # numbers and statistics
    Tool("numbers.binomial_coefficient", "Number of ways to choose k items from n.",
         (P("n", "integer", "Size of the set.", _ints(5, 40), "from {v} items", "out of {v}"),
          P("k", "integer", "Items chosen.", _ints(1, 5), "{v} at a time", "choosing {v}")),
         ("In how many ways can I pick {args}?", "Count the combinations {args}.")),
    Tool("numbers.greatest_divisor", "Greatest common divisor of two integers.",
         (P("a", "integer", "First integer.", (12, 36, 84, 126, 462), "{v}"),
          P("b", "integer", "Second integer.", (18, 48, 90, 210, 1071), "{v}")),
         ("What is the largest number dividing both {args}?", "Greatest common divisor, {args}?")),
    Tool("stats.sample_median", "Median of a list of numbers.",
         (P("values", "array", "The numbers.", (4.0, 9.5, 15.0, 16.25, 23.0, 42.0, 7.5), "{v}"),),
         ("What is the median of {args}?", "Median for {args}?")),
    Tool("stats.z_score_of", "Standard score of a value in a normal distribution.",
         (P("value", "float", "Observed value.", (72.0, 130.0, 8.4), "a value of {v}", "an observation of {v}"),
          P("mean", "float", "Distribution mean.", (65.0, 100.0, 7.9), "a mean of {v}"),
          P("std_dev", "float", "Standard deviation.", (4.0, 15.0, 0.3), "a spread of {v}")),
         ("What z-score has {args}?", "Standardise {args}.")),
    Tool("numbers.prime_check", "Whether an integer is prime.",
         (P("number", "integer", "The integer.", (97, 221, 7919, 1001, 65537), "{v}"),),
         ("Is {args} a prime?", "Tell me if {args} is prime.")),
    # conversions
    Tool("units.length_convert", "Converts a length between units.",
         (P("value", "float", "Length.", (3.5, 12.0, 100.0, 42.195), "{v}"),
          P("from_unit", "string", "Unit of the value.", UNITS_LEN, "~{v}", enum=True),
          P("to_unit", "string", "Target unit.", UNITS_LEN, "in {v}", enum=True)),
         ("How long is {args}?", "Express {args}.")),
    Tool("units.oven_temperature", "Converts an oven temperature between Celsius and Fahrenheit.",
         (P("degrees", "integer", "Temperature.", (160, 180, 200, 350, 425), "{v} degrees"),
          P("scale", "string", "Scale of the given value.", ("celsius", "fahrenheit"), "on the {v} scale",
            enum=True)),
         ("What is {args} in the other scale?", "Convert an oven setting of {args}.")),
    # lookups
    Tool("meteo.daily_outlook", "Weather outlook for a city for the next days.",
         (P("city", "string", "City name.", CITIES, "for {v}", "in {v}"),
          P("days", "integer", "Days ahead.", _ints(1, 7), "over the next {v} days", default=1),
          P("units", "string", "metric or imperial.", ("metric", "imperial"), "in {v} units", enum=True,
            default="metric")),
         ("What will the weather be like {args}?", "Will it rain {args}?")),
    Tool("travel.train_connections", "Train connections between two cities on a date.",
         (P("origin", "string", "Departure city.", CITIES, "from {v}"),
          P("destination", "string", "Arrival city.", CITIES, "to {v}"),
          P("date", "string", "Travel date, YYYY-MM-DD.", DATES, "on {v}")),
         ("Which trains go {args}?", "Are there trains {args}?")),
    Tool("travel.hostel_beds", "Free hostel beds in a city for a number of nights.",
         (P("city", "string", "City name.", CITIES, "in {v}"),
          P("nights", "integer", "Nights of stay.", _ints(1, 6), "for {v} nights"),
          P("max_price", "integer", "Highest price per night.", (20, 35, 60), "under {v} a night", default=0)),
         ("Can I find a hostel bed {args}?", "Any hostel beds {args}?")),
    Tool("food.eatery_finder", "Restaurants of a cuisine in a city.",
         (P("cuisine", "string", "Kind of food.", CUISINES, "{v} food", "a {v} place"),
          P("city", "string", "City name.", CITIES, "in {v}"),
          P("open_now", "boolean", "Only places open now.", (True,), "open right now", default=False)),
         ("Where can I eat {args}?", "Recommend {args}.")),
    Tool("food.recipe_ideas", "Recipes built around an ingredient.",
         (P("ingredient", "string", "Main ingredient.", INGREDIENTS, "with {v}", "using {v}"),
          P("max_minutes", "integer", "Longest preparation time.", (15, 30, 45), "ready in {v} minutes",
            default=60)),
         ("What can I cook {args}?", "Suggest a dish {args}.")),
    Tool("food.nutrition_facts", "Calories and macronutrients of a food portion.",
         (P("food", "string", "Food name.", INGREDIENTS, "{v}"),
          P("grams", "integer", "Portion in grams.", (50, 100, 150, 200), "{v} grams of", "a {v} g portion of")),
         ("How many calories are in {args}?", "Nutrition of {args}?")),
    Tool("sport.league_table", "Standing of a team in its league for a season.",
         (P("team", "string", "Team name.", TEAMS, "the {v}"),
          P("season", "integer", "Season's starting year.", _ints(2015, 2026), "in {v}", "in the {v} season")),
         ("Where did {args} finish?", "League position of {args}?")),
    Tool("sport.match_fixtures", "Upcoming matches of a team.",
         (P("team", "string", "Team name.", TEAMS, "the {v}"),
          P("count", "integer", "How many matches.", _ints(2, 6), "next {v}", default=3)),
         ("When do {args} play?", "Fixtures for {args}?")),
    Tool("books.author_titles", "Books written by an author.",
         (P("author", "string", "Author's full name.", AUTHORS, "{v}"),
          P("since_year", "integer", "Earliest publication year.", (1990, 2005, 2015), "since {v}", default=0)),
         ("Which books are there by {args}?", "List the novels of {args}.")),
    Tool("music.gig_listings", "Concerts of a genre in a city.",
         (P("genre", "string", "Music genre.", GENRES, "{v}", "some {v}"),
          P("city", "string", "City name.", CITIES, "in {v}"),
          P("date", "string", "Date, YYYY-MM-DD.", DATES, "on {v}", default="")),
         ("Where can I hear {args}?", "Any concerts: {args}?")),
    Tool("places.population_of", "Population of a country in a given year.",
         (P("country", "string", "Country name.", COUNTRIES, "{v}"),
          P("year", "integer", "Year.", _ints(1990, 2025, 5), "in {v}")),
         ("How many people lived in {args}?", "Population of {args}?")),
    Tool("places.time_zone_now", "Local time in a city.",
         (P("city", "string", "City name.", CITIES, "{v}"),),
         ("What time is it in {args} right now?", "Local time for {args}?")),
    Tool("health.body_fat_estimate", "Body-fat percentage from waist, neck and height (navy method).",
         (P("waist_cm", "float", "Waist in centimetres.", (78.0, 86.5, 95.0), "a {v} cm waist"),
          P("neck_cm", "float", "Neck in centimetres.", (34.0, 38.5, 41.0), "a {v} cm neck"),
          P("height_cm", "float", "Height in centimetres.", (165.0, 178.0, 190.0), "{v} cm tall")),
         ("Estimate the body fat of someone with {args}.", "Body-fat share, {args}?")),
    Tool("health.daily_water_need", "Recommended daily water intake.",
         (P("weight_kg", "float", "Body weight in kilograms.", (55.0, 68.0, 82.0, 95.0), "{v} kg"),
          P("active_minutes", "integer", "Minutes of exercise a day.", (0, 30, 90), "{v} active minutes",
            default=0)),
         ("How much water should someone of {args} drink?", "Water a day for {args}?")),
)
# questions no tool of the catalogue answers (irrelevance requests without a tool of their own)
OPEN_QUESTIONS = (
    "Who painted the ceiling of the chapel in the old town hall of Tallinn?",
    "Write a haiku about autumn fog over a harbour.",
    "Why do cats knead blankets before lying down?",
    "Which language has the most native speakers in South America?",
    "Summarise the plot of a novel about a lighthouse keeper in two sentences.",
    "What is the difference between a virus and a bacterium?",
    "Tell me a joke about accountants.",
    "How do I say thank you in Georgian?",
    "What does a sommelier do all day?",
    "Explain photosynthesis to a ten-year-old.",
    "Who invented the printing press, and when?",
    "Give me three tips for a job interview.",
    "What is the tallest mountain in Africa?",
    "How should I water a fern kept indoors?",
    "Translate 'good morning' into Portuguese.",
    "What are the rules of chess castling?",
)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


# an argument phrase opening with one of these (or marked "~") follows the previous one after a space
# ("in Oslo over the next 3 days"); other phrases are noun phrases joined by commas and "and"
_ATTACHED = {"in", "on", "for", "from", "to", "into", "over", "at", "by", "with", "under", "since", "measured",
             "growing", "compounded", "moving", "ready", "using", "open", "split", "between", "after", "of", "next"}


def _join_args(phrases: list[str]) -> str:
    out, group = [], []
    for p in phrases:
        if p.startswith("~") or p.split()[0] in _ATTACHED:
            if group:
                out.append(_join(group))
            group = []
            out.append(p.lstrip("~"))
        else:
            group.append(p)
    if group:
        out.append(_join(group))
    return " ".join(out)


def _value(p: Param, rng: random.Random) -> Any:
    if p.type == "array":
        return rng.sample(list(p.values), rng.randint(3, 5))
    return rng.choice(p.values)


def _phrase(p: Param, value: Any, rng: random.Random) -> str:
    if p.type == "boolean":
        return rng.choice(p.phrases)  # only True is sampled for an optional flag; its phrase states it
    shown = _join([str(x) for x in value]) if isinstance(value, list) else str(value)
    return rng.choice(p.phrases).format(v=shown)


def _args(tool: Tool, rng: random.Random, fixed: dict | None = None) -> tuple[dict, list[Param]]:
    """Every required argument and about half of the optional ones (``fixed`` values kept)."""
    fixed = fixed or {}
    args = {}
    stated = []
    for p in tool.params:
        if p.name in fixed:
            args[p.name] = fixed[p.name]
        elif p.default is None or rng.random() < 0.4:
            args[p.name] = _value(p, rng)
        else:
            continue
        stated.append(p)
    return args, stated


def _question(tool: Tool, args: dict, stated: list[Param], rng: random.Random, shown: dict | None = None) -> str:
    shown = shown or {}
    phrases = [shown.get(p.name) or _phrase(p, args[p.name], rng) for p in stated]
    return rng.choice(tool.asks).format(args=_join_args(phrases))


def _parallel(tool: Tool, rng: random.Random) -> tuple[str, list[dict]]:
    """One question asking for 2-4 calls of ``tool``: several values of one (non-list) argument, the
    others shared, or 2 full argument sets joined by "and also"."""
    n = rng.randint(2, 4)
    scalar = [p for p in tool.params if p.type not in ("array", "boolean") and p.default is None]
    varied = rng.choice(scalar) if scalar else None
    if varied is not None and len(set(varied.values)) >= n and rng.random() < 0.7:
        values = rng.sample(list(dict.fromkeys(varied.values)), n)
        args, stated = _args(tool, rng, fixed={varied.name: values[0]})
        shown = {varied.name: rng.choice(varied.phrases).format(v=_join([str(v) for v in values]))}
        text = _question(tool, args, stated, rng, shown)
        return text, [{tool.name: {**args, varied.name: v}} for v in values]
    first, s1 = _args(tool, rng)
    second, s2 = _args(tool, rng)
    if first == second:
        return _parallel(tool, rng)
    text = _question(tool, first, s1, rng)
    tail = _join_args([_phrase(p, second[p.name], rng) for p in s2])
    return f"{text[:-1]}, and also for {tail}{text[-1]}", [{tool.name: first}, {tool.name: second}]


def _example(scenario: str, rng: random.Random) -> dict:
    cat = list(CATALOGUE)
    if scenario == "irrelevance":
        offered = rng.sample(cat, rng.randint(1, 3))
        if rng.random() < 0.3:
            query = rng.choice(OPEN_QUESTIONS)
        else:
            asked = rng.choice([t for t in cat if t not in offered])
            query = _question(asked, *_args(asked, rng), rng)
        return {"scenario": scenario, "query": query, "functions": [t.schema() for t in offered], "calls": []}
    offered = rng.sample(cat, 1 if scenario in ("simple", "parallel") else rng.randint(2, 4))
    if scenario in ("simple", "multiple"):
        tool = rng.choice(offered)
        args, stated = _args(tool, rng)
        query, calls = _question(tool, args, stated, rng), [{tool.name: args}]
    elif scenario == "parallel":
        query, calls = _parallel(offered[0], rng)
    else:  # parallel_multiple: one question per called tool, joined
        tools = rng.sample(offered, 2)
        parts, calls = [], []
        for t in tools:
            args, stated = _args(t, rng)
            parts.append(_question(t, args, stated, rng))
            calls.append({t.name: args})
        query = f"{parts[0]} And {parts[1][0].lower()}{parts[1][1:]}"
    return {"scenario": scenario, "query": query, "functions": [t.schema() for t in offered], "calls": calls}


def generate(n: int, seed: int = 0, mix: dict[str, float] | None = None) -> list[dict]:
    """``n`` distinct records (distinct query + offered functions), deterministic for ``seed`` and
    ``mix`` (scenario -> weight; default DEFAULT_MIX). Raises ValueError for an unknown scenario or
    when ``n`` distinct records cannot be found."""
    rng = random.Random(seed)
    return distinct_records(n, DEFAULT_MIX if mix is None else mix, lambda s: _example(s, rng), rng, "questions")


def catalogue_names() -> list[str]:
    """The names of every function the generator can offer."""
    return [t.name for t in CATALOGUE]
