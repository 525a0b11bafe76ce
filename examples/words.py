"""A word list written for the examples: short, common English nouns that tokenize plainly."""

WORDS = """
apple bread chair dog eagle fish garden house island jacket kite lemon mountain night orange pencil
queen river stone table umbrella valley window yellow zebra anchor basket candle desert engine forest
guitar hammer iron jungle kettle ladder mirror needle ocean pillow rabbit saddle tiger violin wagon
banana carrot dragon feather glove harbor insect jelly kitchen lizard monkey nest onion parrot rocket
silver tomato uncle village wheel butter cloud dinner finger grape honey letter meadow number olive
planet riddle spider turtle wallet arrow bottle cotton doctor farmer ginger helmet input jewel kernel
lantern magnet napkin oyster pepper quilt ribbon sugar thunder velvet walnut yogurt blanket cactus
diamond fountain goose hollow igloo juice koala lobster marble noodle orchid pumpkin raisin salmon
teapot tulip vase whale acorn beetle cherry dolphin falcon garlic hazel kitten mango nectar pebble
""".split()
