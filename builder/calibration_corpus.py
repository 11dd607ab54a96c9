"""The builder's offline default calibration text.

Why this text: calibration must work with no network and without ../shared/data (which may be
absent), and it must differ from the held-out evaluation text (Botchan, used for the README quality
table). It is a fixed, versioned string, so builds are reproducible on any machine, unlike text the
model samples itself (which depends on kernels and thread counts) and at no generation cost.

Content: short passages of public-domain English prose (all published before 1870: Lincoln's
Gettysburg Address, the opening of the US Declaration of Independence, and the openings of Dickens'
"A Tale of Two Cities", Austen's "Pride and Prejudice" and Melville's "Moby-Dick"), typed in from
memory, so the wording may differ slightly from the canonical editions (irrelevant for calibration),
followed by a few paragraphs written for this project (technical prose, a Python function and a
question/answer exchange) so code and instruction-style text are represented too, as an
instruction-tuned model sees them when serving. About 1,800 tokens with the SmolLM2 tokenizer.
"""

from __future__ import annotations

DEFAULT_CALIBRATION_NAME = "builtin:public-domain-prose+project-text:v1"

_PASSAGES: tuple[str, ...] = (
    # Abraham Lincoln, Gettysburg Address (1863). Public domain.
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived "
    "in Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a "
    "great civil war, testing whether that nation, or any nation so conceived and so dedicated, can long "
    "endure. We are met on a great battle-field of that war. We have come to dedicate a portion of that "
    "field, as a final resting place for those who here gave their lives that that nation might live. It is "
    "altogether fitting and proper that we should do this. But, in a larger sense, we can not dedicate -- we "
    "can not consecrate -- we can not hallow -- this ground. The brave men, living and dead, who struggled "
    "here, have consecrated it, far above our poor power to add or detract. The world will little note, nor "
    "long remember what we say here, but it can never forget what they did here. It is for us the living, "
    "rather, to be dedicated here to the unfinished work which they who fought here have thus far so nobly "
    "advanced. It is rather for us to be here dedicated to the great task remaining before us -- that from "
    "these honored dead we take increased devotion to that cause for which they gave the last full measure "
    "of devotion -- that we here highly resolve that these dead shall not have died in vain -- that this "
    "nation, under God, shall have a new birth of freedom -- and that government of the people, by the "
    "people, for the people, shall not perish from the earth.",
    # The Declaration of Independence (1776), opening. Public domain.
    "When in the Course of human events, it becomes necessary for one people to dissolve the political "
    "bands which have connected them with another, and to assume among the powers of the earth, the "
    "separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent "
    "respect to the opinions of mankind requires that they should declare the causes which impel them to "
    "the separation. We hold these truths to be self-evident, that all men are created equal, that they "
    "are endowed by their Creator with certain unalienable Rights, that among these are Life, Liberty and "
    "the pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving "
    "their just powers from the consent of the governed, That whenever any Form of Government becomes "
    "destructive of these ends, it is the Right of the People to alter or to abolish it, and to institute "
    "new Government, laying its foundation on such principles and organizing its powers in such form, as "
    "to them shall seem most likely to effect their Safety and Happiness. Prudence, indeed, will dictate "
    "that Governments long established should not be changed for light and transient causes; and "
    "accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils are "
    "sufferable, than to right themselves by abolishing the forms to which they are accustomed.",
    # Charles Dickens, A Tale of Two Cities (1859), opening. Public domain.
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way -- in short, the period was so far like the present period, that some of its "
    "noisiest authorities insisted on its being received, for good or for evil, in the superlative degree "
    "of comparison only. There were a king with a large jaw and a queen with a plain face, on the throne of "
    "England; there were a king with a large jaw and a queen with a fair face, on the throne of France. In "
    "both countries it was clearer than crystal to the lords of the State preserves of loaves and fishes, "
    "that things in general were settled for ever.",
    # Jane Austen, Pride and Prejudice (1813), opening. Public domain.
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering "
    "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said "
    "his lady to him one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied "
    "that he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all "
    "about it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken it?\" cried his wife "
    "impatiently. \"You want to tell me, and I have no objection to hearing it.\" This was invitation "
    "enough. \"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large "
    "fortune from the north of England; that he came down on Monday in a chaise and four to see the place, "
    "and was so much delighted with it, that he agreed with Mr. Morris immediately; that he is to take "
    "possession before Michaelmas, and some of his servants are to be in the house by the end of next week.\"",
    # Herman Melville, Moby-Dick (1851), opening. Public domain.
    "Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no money in my "
    "purse, and nothing particular to interest me on shore, I thought I would sail about a little and see "
    "the watery part of the world. It is a way I have of driving off the spleen and regulating the "
    "circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly "
    "November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and "
    "bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper hand "
    "of me, that it requires a strong moral principle to prevent me from deliberately stepping into the "
    "street, and methodically knocking people's hats off -- then, I account it high time to get to sea as "
    "soon as I can. This is my substitute for pistol and ball. With a philosophical flourish Cato throws "
    "himself upon his sword; I quietly take to the ship. There is nothing surprising in this. If they but "
    "knew it, almost all men in their degree, some time or other, cherish very nearly the same feelings "
    "towards the ocean with me.",
    # Written for this project (Apache-2.0): technical prose.
    "A language model server receives requests from many users at once. Each request carries a prompt, "
    "and the server must first process the whole prompt (the prefill) before it can generate the answer "
    "one token at a time (the decode). The keys and values computed for every token are kept in a cache so "
    "that later tokens do not repeat the work. When many long requests arrive together, this cache fills "
    "the memory of the accelerator, new requests wait in a queue, and the time to the first token grows. "
    "One remedy is to store some layers of the model with fewer bits per weight while the pressure lasts: "
    "the memory they free holds more cached tokens, and the layers are restored to full precision when the "
    "load drops. Which layers to compress first matters, because some layers change the result far more "
    "than others when their weights are rounded.",
    # Written for this project (Apache-2.0): code.
    "def moving_average(values: list[float], window: int) -> list[float]:\n"
    "    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"\n"
    "    if window <= 0:\n"
    "        raise ValueError(f\"window must be positive, got {window}\")\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n\n\n"
    "print(moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 2))  # [1.5, 2.5, 3.5, 4.5]\n",
    # Written for this project (Apache-2.0): question and answer.
    "Question: Why does water boil at a lower temperature on a high mountain?\n"
    "Answer: Water boils when its vapour pressure equals the pressure of the air above it. High on a "
    "mountain the air pressure is lower, so the water reaches that point at a lower temperature; at about "
    "three thousand metres it boils near ninety degrees Celsius, which is why food takes longer to cook "
    "there.\n\n"
    "Question: Name three primary colors.\n"
    "Answer: Red, yellow and blue are the traditional primary colors of paint; for light, the primaries are "
    "red, green and blue.\n\n"
    "Question: What is the capital of France, and what river runs through it?\n"
    "Answer: The capital of France is Paris, and the Seine runs through the middle of the city.",
)

DEFAULT_CALIBRATION_TEXT: str = "\n\n".join(_PASSAGES) + "\n"
