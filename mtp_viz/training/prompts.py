"""Training prompts for the drafters: varied instructions built from templates, never Spec-Bench.

Spec-Bench (mtp_viz/data) is the held-out evaluation set, so nothing here is drawn from it. The
categories mirror its mix (writing, roleplay, reasoning, math, coding, extraction, STEM,
humanities, translation, summarization, QA, retrieval-augmented QA). Summarization and
context-QA prompts need documents: `context_prompts` builds them from the target's own answers
to the first round, so the drafters also see long inputs they must copy from.
"""

import random

TOPICS = (
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "climate change",
    "the human immune system",
    "machine learning",
    "the Roman Empire",
    "volcanoes",
    "the stock market",
    "electric cars",
    "honeybees",
    "the printing press",
    "plate tectonics",
    "vaccines",
    "the Internet",
    "renewable energy",
    "ancient Egypt",
    "the water cycle",
    "DNA",
    "the Cold War",
    "coffee",
    "the Great Wall of China",
    "jazz music",
    "chess",
    "the Moon landing",
    "earthquakes",
    "the Renaissance",
    "coral reefs",
    "inflation",
    "social media",
    "the Industrial Revolution",
    "rainforests",
    "quantum computers",
    "the Olympic Games",
    "antibiotics",
    "the solar system",
    "democracy",
    "sleep",
    "recycling",
    "the Silk Road",
    "artificial satellites",
    "dinosaurs",
    "nuclear energy",
    "the human brain",
    "supply and demand",
    "Shakespeare",
    "glaciers",
    "bicycles",
    "the printing of money",
    "tea ceremonies",
    "hurricanes",
    "cryptography",
    "the Amazon river",
    "urban gardening",
    "the Byzantine Empire",
    "electric guitars",
    "tides",
    "public libraries",
    "3D printing",
    "mushrooms",
    "the metric system",
    "airplanes",
    "microplastics",
    "the Beatles",
    "the theory of evolution",
    "bread baking",
    "lighthouses",
    "the periodic table",
    "wind turbines",
    "the Mongol Empire",
    "penguins",
    "remote work",
    "the Eiffel Tower",
    "vitamins",
    "compound interest",
    "submarines",
    "the Nile",
    "meditation",
    "video games",
    "the immune response to allergies",
    "origami",
    "the history of writing",
    "desert ecosystems",
    "batteries",
    "the Magna Carta",
    "octopuses",
    "time zones",
    "smartphones",
    "the Aztecs",
    "bridges",
    "minimalism",
    "the speed of light",
    "elephants",
    "public transport",
    "the Viking age",
    "semiconductors",
    "marathon running",
    "the ozone layer",
    "impressionist painting",
    "whales",
    "the scientific method",
    "opera",
    "cloud computing",
    "wolves",
    "the Apollo program",
    "soil erosion",
    "national parks",
    "the piano",
    "gravity",
    "trade unions",
)

PEOPLE = (
    "a pirate captain",
    "a medieval knight",
    "a famous chef",
    "a detective",
    "an astronaut on Mars",
    "a kindergarten teacher",
    "a sports commentator",
    "a wise old wizard",
    "a tour guide in Rome",
    "a startup founder",
    "a park ranger",
    "a robot learning about humans",
    "a 1920s jazz musician",
)

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")

SENTENCES = (
    "The weather is beautiful today, so we are going to the beach.",
    "Could you tell me where the nearest train station is?",
    "My brother has been learning to play the violin for three years.",
    "The museum opens at nine in the morning and closes at six.",
    "We need to buy bread, milk and eggs before the shop closes.",
    "The conference was postponed because of the storm.",
    "She wrote a letter to her grandmother every Sunday.",
    "The new bridge will connect the two sides of the city.",
    "I would like to book a table for four people tonight.",
    "Scientists discovered a new species of frog in the rainforest.",
    "The children played football in the park until sunset.",
    "Please remember to turn off the lights when you leave.",
)

GERMAN = (
    "Die Regierung hat neue Maßnahmen zum Klimaschutz angekündigt .",
    "Der Zug nach Berlin hat heute zwanzig Minuten Verspätung .",
    "Viele Studenten arbeiten neben dem Studium in einem Café .",
    "Das Museum zeigt eine Ausstellung über die Geschichte der Stadt .",
    "Im Sommer fahren wir mit dem Fahrrad an den See .",
    "Die Preise für Lebensmittel sind im letzten Jahr stark gestiegen .",
    "Der Bürgermeister eröffnete gestern die neue Bibliothek .",
    "Die Mannschaft gewann das Spiel nach einem späten Tor .",
    "Forscher haben einen neuen Impfstoff gegen die Krankheit entwickelt .",
    "Am Wochenende findet auf dem Marktplatz ein großes Fest statt .",
)

TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "counts the vowels in a sentence",
    "merges two sorted lists",
    "computes the factorial of n",
    "finds the largest element in a list",
    "removes duplicates from a list while keeping the order",
    "converts Celsius to Fahrenheit",
    "checks whether a word is a palindrome",
    "returns the n-th Fibonacci number",
    "reads a CSV file and prints the average of a column",
    "flattens a nested list",
    "counts how often each word appears in a text",
    "implements binary search",
    "validates an email address with a regular expression",
    "sorts a list of dictionaries by a key",
)

TEMPLATES = {
    "writing": (
        "Write a short story about {topic}.",
        "Compose an engaging blog post about {topic}.",
        "Write a poem about {topic}.",
        "Draft a short email to a colleague proposing a team outing related to {topic}.",
        "Write a persuasive paragraph arguing why everyone should learn about {topic}.",
        "Write a product description for a new gadget inspired by {topic}.",
    ),
    "roleplay": (
        "Pretend you are {person}. Tell me about {topic}.",
        "Act as {person} and give me advice about {topic}.",
        "You are {person}. Describe your typical day and how {topic} fits into it.",
    ),
    "stem": (
        "Explain {topic} in simple terms.",
        "How does {topic} work?",
        "What are the most important facts about {topic}?",
        "Explain {topic} to a ten-year-old.",
    ),
    "humanities": (
        "What was the historical significance of {topic}?",
        "Discuss the cultural impact of {topic}.",
        "What are the main arguments for and against {topic}?",
    ),
    "qa": (
        "What is {topic}?",
        "Give me three interesting facts about {topic}.",
        "What is the difference between {topic} and {other}?",
        "Why is {topic} important?",
    ),
    "reasoning": (
        "List the pros and cons of {topic} and give a balanced conclusion.",
        "If {topic} disappeared tomorrow, what would change? Reason step by step.",
        "Compare {topic} and {other}. Which has had the greater effect on daily life, and why?",
    ),
    "coding": (
        "Write a Python function that {task}.",
        "Write a JavaScript function that {task}, with a short explanation.",
        "Explain step by step how to write a program that {task}.",
    ),
    "translation": (
        "Translate the following sentence into {language}: {sentence}",
        "Translate German to English: {german}",
    ),
}

MATH_TEMPLATES = (
    "A shop sells {a} apples every day. How many apples does it sell in {b} days?",
    "Tom has {a} marbles. He gives {b} marbles to his friend and then buys {c} more. How many marbles does he have?",
    "A train travels at {a} km per hour. How far does it travel in {b} hours?",
    "A book costs ${a} and a pen costs ${b}. How much do {c} books and {c} pens cost together?",
    "What is {a} multiplied by {b}?",
    "Solve for x: {a}x + {b} = {c}.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Sarah saves ${a} a week. How many weeks does she need to save ${c}0?",
    "There are {a} students in a class and {b} of them are girls. What percentage are boys?",
    "A recipe needs {b} eggs for {a} cookies. How many eggs are needed for {c}0 cookies?",
)

# Multi-step word problems answered step by step (the self-distilled MTP model's main gains are
# on such answers). Made from templates with random numbers, never from GSM8K or Spec-Bench.
WORD_PROBLEMS = (
    "{name} has {a} stickers. {name} buys {b} packs with {c} stickers each, then gives away {d}. "
    "How many stickers are left?",
    "A farmer has {a} cows and {b} chickens. How many legs do the animals have in total?",
    "A bakery makes {a} loaves a day and sells each for ${c}. How much money does it make in {b} days?",
    "{name} reads {c} pages a day. The book has {a}{b} pages. How many days does it take to finish it?",
    "A car uses {c} liters of fuel per 100 km. How much fuel does it need for a trip of {a}{d} km?",
    "A class of {a} students goes on a trip. Each bus holds {c} students. How many buses are needed?",
    "{name} earns ${a} an hour and works {b} hours a week. How much does {name} earn in {c} weeks?",
    "A shirt costs ${a}{d}. It is on sale for {c}0% off. What is the sale price?",
    "A tank holds {a}0 liters. It is filled at {c} liters per minute. How long until it is full?",
    "{name} is {c} years old. Their mother is {a} years older. How old will the mother be in {b} years?",
    "A garden is {a} m by {b} m. A path {c} m wide runs around it. What is the area of the path?",
    "There are {a} red balls and {b} blue balls in a bag. What fraction of the balls are red?",
    "A store had {a}{b} toys. It sold {c}{d} on Monday and half of the rest on Tuesday. How many toys are left?",
    "A runner runs {c} km every weekday and {d} km on each weekend day. How far does she run in {b} weeks?",
    "The sum of two numbers is {a}{b} and their difference is {c}. What are the numbers?",
    "{name} buys {b} notebooks at ${c} each and {d} pens at ${a} each, paying with a $500 bill. What is the change?",
)
NAMES = ("Maria", "James", "Aisha", "Chen", "Lucas", "Priya", "Omar", "Sofia", "Kenji", "Emma")
STEP_BY_STEP = (
    "",
    " Solve it step by step.",
    " Show your reasoning step by step, then give the final answer.",
    " Think step by step and end with 'The answer is'.",
)


def math_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct arithmetic word problems (and the simple MATH_TEMPLATES), most asking for steps."""
    rng = random.Random(seed + 7919)
    found: dict[str, None] = {}
    while len(found) < n:
        a, b, c, d = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 12), rng.randint(1, 9)
        template = rng.choice(WORD_PROBLEMS + MATH_TEMPLATES)
        found[template.format(name=rng.choice(NAMES), a=a, b=b, c=c, d=d) + rng.choice(STEP_BY_STEP)] = None
    return list(found)


CONTEXT_TEMPLATES = (
    "Summarize: {doc}",
    "Summarize the following text in three sentences:\n{doc}",
    "{doc}\n\nBased on the text above, what is the main idea?",
    "Read the passage and list its key points.\n\n{doc}",
    "{doc}\n\nAccording to the passage, why does {topic} matter?",
    "Extract every number and name mentioned in this text:\n{doc}",
)


def instruction_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct instructions across the categories (math has random numbers), fixed by seed."""
    rng = random.Random(seed)
    kinds = [*TEMPLATES, "math"]
    prompts: dict[str, None] = {}
    while len(prompts) < n:
        kind = rng.choice(kinds)
        if kind == "math":
            a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 40)
            prompts[rng.choice(MATH_TEMPLATES).format(a=a, b=b, c=c)] = None
            continue
        template = rng.choice(TEMPLATES[kind])
        prompts[
            template.format(
                topic=rng.choice(TOPICS),
                other=rng.choice(TOPICS),
                person=rng.choice(PEOPLE),
                task=rng.choice(TASKS),
                language=rng.choice(LANGUAGES),
                sentence=rng.choice(SENTENCES),
                german=rng.choice(GERMAN),
            )
        ] = None
    return list(prompts)


def context_prompts(documents: list[str], n: int, seed: int = 0) -> list[str]:
    """n summarization / context-QA prompts over documents (the target's own earlier answers)."""
    rng = random.Random(seed)
    docs = [d.strip() for d in documents if len(d.split()) >= 60]
    if not docs:
        return []
    return [rng.choice(CONTEXT_TEMPLATES).format(doc=rng.choice(docs), topic="this topic") for _ in range(n)]
