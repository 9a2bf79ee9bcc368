"""General-chat evaluation prompts: 48 everyday requests in 8 categories (6 each), written for eaglelab.

Held out: no training source draws from them. `eval.prompts=chat` evaluates a drafter on them, to see how a drafter
trained on code and documentation carries over to conversation.
"""

CHAT_PROMPTS: dict[str, list[str]] = {
    "writing": [
        "Write a short, upbeat message to my team thanking them for finishing the release early.",
        (
            "I need a wedding toast for my younger sister. She's marrying her college sweetheart, they both love "
            "hiking, and I want it to be funny but end on a sweet note. Keep it under two minutes when read aloud."
        ),
        "Can you write a haiku about the first cup of coffee on a cold morning?",
        (
            "Draft a polite email to my landlord asking when the broken dishwasher will be repaired. "
            "It's been three weeks since I first reported it."
        ),
        (
            "Write the opening paragraph of a mystery novel set in a small fishing village where the lighthouse "
            "keeper has gone missing."
        ),
        "Give me a catchy product description for a handmade ceramic mug with a speckled blue glaze, about 80 words.",
    ],
    "roleplay": [
        "Pretend you are a ship's captain in 1850 and describe the storm you just survived to a new sailor.",
        (
            "You're a grumpy medieval blacksmith and I'm a knight who just walked in asking for a sword by tomorrow. "
            "Stay in character and respond."
        ),
        (
            "Act as a friendly tour guide in Rome and welcome me to the Colosseum. "
            "Tell me one thing most tourists don't know about it."
        ),
        (
            "Imagine you're my personal fitness coach and I just told you I skipped the gym all week. "
            "What do you say to me?"
        ),
        "Be a detective from a 1940s noir film and explain to me how you figured out who stole the diamond.",
        (
            "Pretend to be an astronaut on the International Space Station answering a question from a "
            "ten-year-old: what does it feel like to sleep up there?"
        ),
    ],
    "reasoning": [
        (
            "Three friends, Ana, Ben, and Cleo, each own a different pet: a cat, a dog, and a parrot. "
            "Ana is allergic to fur, and Ben is afraid of dogs. Who owns which pet?"
        ),
        (
            "If all roses are flowers and some flowers fade quickly, can we conclude that some roses fade quickly? "
            "Explain why or why not."
        ),
        (
            "I'm choosing between a job with a higher salary and a long commute, and one that pays less but is "
            "a ten-minute walk away. What factors should I weigh, and how would you reason through it?"
        ),
        (
            "A man looks at a portrait and says, \"Brothers and sisters I have none, but that man's father is my "
            "father's son.\" Who is in the portrait?"
        ),
        "Why might a store put milk at the very back, and is that explanation actually convincing?",
        (
            "You have two ropes that each take exactly one hour to burn, but they burn unevenly. "
            "How can you measure exactly 45 minutes?"
        ),
    ],
    "math": [
        "What is 15% of 240, and how would I work it out in my head quickly?",
        (
            "A train leaves at 2:15 pm and travels 180 miles at an average of 60 miles per hour. "
            "What time does it arrive?"
        ),
        "Explain in simple terms why dividing by zero is undefined.",
        (
            "I want to save $6,000 for a trip in 18 months. How much should I put aside each month, "
            "and how much each week?"
        ),
        "Solve for x: 3x + 7 = 2x - 5. Show each step.",
        (
            "A rectangular garden is twice as long as it is wide, and its perimeter is 54 meters. "
            "What are its length, width, and area?"
        ),
    ],
    "extraction": [
        (
            'Pull out every date and the event it goes with from this note: "The kickoff meeting is on March 4. '
            'Drafts are due April 12, and the final report goes to the board on May 30."'
        ),
        (
            'From this review, list the pros and cons the customer mentions: "The blender is powerful and easy '
            "to clean, but it's really loud and the lid started cracking after two months.\""
        ),
        (
            'Extract the names, ages, and cities from this text as a table: "Maria, 34, lives in Lisbon. '
            'Her cousin Tomas is 29 and just moved to Porto, while their friend Ines, 41, stayed in Braga."'
        ),
        (
            'What ingredients and quantities are in this recipe? "Whisk two eggs with a cup of milk, fold in '
            'one and a half cups of flour, add a pinch of salt and a tablespoon of melted butter."'
        ),
        (
            'Identify the company, the product, and the launch price in this announcement: "Northwind Audio '
            'today unveiled the Breeze 2 wireless headphones, available next month for $149."'
        ),
        (
            'Summarize the action items and who owns each one: "Priya will book the venue by Friday. '
            'Sam needs to send invitations once the venue is confirmed, and Lee is handling the catering quotes."'
        ),
    ],
    "science": [
        "Why is the sky blue during the day but red and orange at sunset?",
        "How do vaccines train the immune system to recognize a virus? Keep it understandable for a high schooler.",
        ("What actually happens inside a microwave oven that makes food hot? And why shouldn't I put metal in it?"),
        "Explain the difference between weather and climate, with an example of each.",
        "How do bridges handle getting longer in summer heat without cracking?",
        (
            "What is CRISPR, and why are scientists so excited about it? "
            "Please mention at least one concern people have raised."
        ),
    ],
    "humanities": [
        "What were the main causes of the fall of the Western Roman Empire?",
        (
            "Compare the philosophies of Stoicism and Epicureanism. "
            "Which one do you think is more useful for dealing with stress today?"
        ),
        "Why is Shakespeare's Hamlet still performed so often, four centuries after it was written?",
        (
            "Give me a short overview of the Harlem Renaissance: when it happened, who the key figures were, "
            "and why it mattered."
        ),
        "How did the invention of the printing press change religion and politics in Europe?",
        (
            'What does the word "sonder" mean, and are there similar ideas in other languages or cultures? '
            "I came across it recently and can't stop thinking about it."
        ),
    ],
    "advice": [
        (
            "I have a job interview on Monday for a marketing role and I get really nervous. "
            "Any tips for staying calm and coming across confident?"
        ),
        "My roommate keeps leaving dishes in the sink for days. How do I bring it up without starting a fight?",
        (
            "I want to start running but I've never been athletic. "
            "How should I begin so I don't get injured or give up after a week?"
        ),
        "What are some good ways to make friends in a new city when you work from home?",
        (
            "My grandmother just turned 80 and lives alone. What are some small, practical ways I can help "
            "her stay independent and safe?"
        ),
        "How can I stop checking my phone first thing every morning?",
    ],
}


def chat_prompts() -> list[list[dict[str, str]]]:
    """The 48 prompts as single-user-turn conversations, category by category."""
    return [[{"role": "user", "content": text}] for texts in CHAT_PROMPTS.values() for text in texts]
