"""machinery/toy_corpus.py: the built-in corpus, a synthetic language pair that needs no download.

``python data.py`` builds it in data/toy/ and describes it (summary, which machinery/corpora.py's
main() calls); train.py without --data trains on it (corpora.read_corpus calls make_toy_corpus),
and so do the tests. make_toy_corpus writes it once: its stamp file keeps it until the settings or
TOY_VERSION change.

The pair ("src" -> "tgt") needs what real translation needs: reordering, agreement, a long tail of
rare words. The source is English-like (SVO, determiners and adjectives before the noun,
prepositions, relative clauses with "that", "and" between clauses, time adverbs at the end); the
target, an invented language, is a deterministic function of it:
  - word order: the verb goes last (SOV), a sentence-level place phrase right after the subject,
    time adverbs to the front; a noun phrase is mirrored (noun, adjectives reversed, determiner);
    prepositions become postpositions; a relative clause stays after its noun but is verb-final
    too ("that sees the cat" -> "ke <cat>-k <see>");
  - morphology: nouns take plural "-li" and accusative "-k"/"-ek", adjectives agree in number
    ("-n"), verbs take tense ("-ta" past, "-su" future) and person ("-m", "-s", "", "-mos", "-n");
    "a"/"an" goes, "does not" -> "ma";
  - vocabulary: 243 nouns, 57 verbs and 47 adjectives with Zipf frequencies, plus 3000 invented
    proper names with a very long Zipf tail (most occur once or never in training), transliterated
    letter by letter (c,q->k w->v y->i j->y x->ks): the model must learn to copy and rewrite
    subword pieces it may never have seen whole.
Example pair (seed 1, line 83 of train.src / train.tgt):
    src: the green man that likes us will not take Thullockmeyth beside a table .
    tgt: mibiso pida na ke nosek riko neto kana Thullokkmeithek ma pavisu .
    gloss: man green the | that us-ACC like | table beside | Thullockmeyth-ACC | NEG take-FUT .
"""

import contextlib
import itertools
import json
import random
from collections import Counter
from pathlib import Path

import data
from machinery.fileio import atomic_write_all, corpus_paths
from machinery.speed import timed

TOY_VERSION = 2  # bump when the generator changes, so that old data/toy/ files get rebuilt

# The built-in corpus's default place: data/toy/ in the project's folder, beside the chapters.
TOY_DIR = Path(__file__).resolve().parents[1] / "data" / "toy"

# Nouns, most frequent first (the Zipf rank); "man:men" an irregular English plural (the target's
# are all regular).
_NOUNS = """dog cat man:men woman:women child:children house friend king teacher bird tree book city
river boy girl horse garden door table letter road mother father doctor farmer apple window car ship
village school market song student queen soldier baby brother sister key hat box cup boat flower
stone star picture story gift coin chair bed bag bottle glass plate knife:knives mouse:mice fox
wolf:wolves bear lion tiger monkey snake frog cow pig goat duck rabbit sailor baker painter singer
writer driver neighbor uncle aunt cousin guest stranger thief judge priest nurse forest mountain
bridge church castle tower island lake field farm hill valley beach harbor station library kitchen
room wall roof basket bowl spoon pen pencil paper map poem ring coat shoe shirt dress boot glove
scarf:scarves umbrella clock lamp candle mirror bell drum flute guitar piano ball toy kite train bus
bicycle wagon lemon banana cherry grape potato:potatoes carrot onion tomato:tomatoes egg cake cookie
sandwich pie leaf:leaves rose branch rock moon cloud storm lantern anchor barrel compass feather
hammer ladder needle saddle shovel spider turtle parrot eagle owl dolphin whale shark crab lobster
camel donkey elephant giraffe zebra squirrel hedgehog beetle butterfly violin trumpet harp statue
fountain tunnel cave cliff meadow orchard vineyard lighthouse windmill chimney cellar attic balcony
staircase carpet curtain pillow blanket kettle teapot jar jug bucket broom brush comb wallet purse
diamond pearl crown sword shield helmet arrow wheel engine rocket planet comet volcano:volcanoes
desert glacier canyon swamp pond stream waterfall"""

# Verbs, transitive then intransitive; "see:saw" an irregular past. No verb whose past is its base
# ("read", "put"): the tense must be recoverable from the source, or the target would not be a
# function of it.
_TRANSITIVE = """see:saw like find:found help call follow watch visit carry love bring:brought
take:took hold:held open buy:bought sell:sold build:built break:broke push pull paint draw:drew
write:wrote clean wash catch:caught throw:threw kick touch hide:hid need want remember forget:forgot
meet:met greet fear admire feed:fed chase lose:lost keep:kept"""
_INTRANSITIVE = """sleep:slept run:ran walk sing:sang dance laugh cry wait swim:swam jump sit:sat
smile work play rest"""

_ADJECTIVES = """big small old young red blue green black white happy sad tall short quiet loud
brave clever lazy angry hungry tired rich poor famous strange beautiful ugly heavy warm cold wet dry
dirty new ancient tiny huge gentle wild proud shy curious lucky noisy sleepy golden wooden"""

# Function words, written by hand so that they stay short: prepositions (source -> target, the
# target's a postposition), pronouns (subject -> (person, object form, target)), the verb's
# endings, time adverbs (each agrees with its clause's tense), determiners ((source, weight,
# target); "" = none).
_PREPOSITIONS = {
    "in": "ulu",
    "on": "sope",
    "under": "dabu",
    "near": "peri",
    "behind": "tolo",
    "beside": "kana",
    "with": "sin",
    "without": "nasin",
    "from": "deko",
    "to": "ade",
}
_PRONOUNS = {
    "I": ("1sg", "me", "mi"),
    "you": ("2sg", "you", "tu"),
    "he": ("3sg", "him", "el"),
    "she": ("3sg", "her", "ela"),
    "we": ("1pl", "us", "nos"),
    "they": ("3pl", "them", "ilo"),
}
_PERSON_SUFFIX = {"1sg": "m", "2sg": "s", "3sg": "", "1pl": "mos", "3pl": "n"}
_TENSE_SUFFIX = {"pres": "", "past": "ta", "fut": "su"}
_TIMES = {
    "past": [("yesterday", "iru"), ("last night", "oneko")],
    "pres": [("today", "oge"), ("every day", "sadi")],
    "fut": [("tomorrow", "mane"), ("next week", "sekan")],
}
_DETS_SG = [("the", 55, "na"), ("a", 30, ""), ("this", 15, "ve")]
_DETS_PL = [
    ("the", 35, "na"),
    ("", 20, ""),
    ("these", 10, "ve"),
    ("some", 10, "sa"),
    ("many", 5, "mul"),
    ("two", 8, "du"),
    ("three", 6, "tre"),
    ("four", 4, "kat"),
    ("five", 2, "pen"),
]

# Proper names: invented, English-looking, rich in the letters transliteration rewrites (copying is
# not enough). A name is 2 or 3 syllables, each an onset, a nucleus and a coda ("" is no coda, twice
# as likely as each other); the target writes it letter by letter as _TRANSLIT says.
_ONSETS = "b c d f g h j k l m n p r s t v w y z br cl dr gw qu th wr x"
_NUCLEI = "a e i o u ay ey oa"
_CODAS = "||n|r|l|s|x|ck|th|m|w"
_TRANSLIT = str.maketrans({"c": "k", "q": "k", "w": "v", "y": "i", "j": "y", "x": "ks"})


def _english(word, ending):
    """A regular English ending: plural or third person singular ("s": boxes, cities, sees), or the
    past ("ed")."""
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "i" + ("es" if ending == "s" else "ed")
    if ending == "s":
        return word + ("es" if word.endswith(("s", "x", "ch", "sh", "z")) else "s")
    return word + ("d" if word.endswith("e") else "ed")


class _ToyGrammar:
    """Samples (source, target) sentence pairs. A method returns one constituent's source and target
    words; the target order is assembled from the parts independently of the source order (the
    reordering). The target stays a function of the source by construction: an object noun phrase
    takes no prepositional phrase, a noun phrase at most one modifier, and a sentence-level place
    phrase or time adverb never comes with a relative clause on the object."""

    def __init__(self, rng):
        """The lexicon (nouns, transitive verbs, intransitive verbs, adjectives, names): one for all
        seeds, from its own generator `lex` (rng, the seed's, picks sentences)."""
        self.rng, lex = rng, random.Random(20191105)
        taken = (
            set(_PREPOSITIONS.values()) | {d[2] for d in _DETS_SG + _DETS_PL} | {"ke", "ma", "i"}
        )

        def new_word(n_syll):  # a target stem: CV syllables, no function word
            while True:
                w = "".join(lex.choice("bdgkmnprstvz") + lex.choice("aeiou") for _ in range(n_syll))
                if w not in taken:
                    taken.add(w)
                    return w

        nouns = [
            (sg, pl or _english(sg, "s"), new_word(lex.choice((2, 3))))
            for sg, _, pl in (e.partition(":") for e in _NOUNS.split())
        ]
        trans, intrans = (
            [
                (base, _english(base, "s"), past or _english(base, "ed"), new_word(2))
                for base, _, past in (e.partition(":") for e in words.split())
            ]
            for words in (_TRANSITIVE, _INTRANSITIVE)
        )
        adjs = [(a, new_word(2)) for a in _ADJECTIVES.split()]
        onsets, nuclei, codas = _ONSETS.split(), _NUCLEI.split(), _CODAS.split("|")
        names = {}  # an ordered set
        while len(names) < 3000:
            syllables = lex.choice((2, 2, 2, 2, 3))
            name = "".join(
                lex.choice(onsets) + lex.choice(nuclei) + lex.choice(codas)
                for _ in range(syllables)
            )
            names[name.capitalize()] = None
        # Zipf's law, exponent s: the r-th most frequent word has frequency ~ 1 / r^s (cumulated
        # once, for random.choices).
        self.lists = {
            kind: (
                words,
                list(itertools.accumulate(1.0 / (r**s) for r in range(1, len(words) + 1))),
            )
            for kind, words, s in (
                ("noun", nouns, 1.1),
                ("trans", trans, 0.8),
                ("intrans", intrans, 0.8),
                ("adj", adjs, 0.8),
                ("name", list(names), 1.1),
            )
        }

    def pick(self, kind):
        words, cum_weights = self.lists[kind]
        return self.rng.choices(words, cum_weights=cum_weights)[0]

    def noun_phrase(self, case, modifier=None):
        """(src, tgt, person); case "nom", "acc" or "obl", modifier None, "pp" or "rel"."""
        r, kind = self.rng, self.rng.random()

        def acc(word):  # the accusative ending, on an object
            if case != "acc":
                return word
            return word + ("k" if word[-1] in "aeiou" else "ek")

        if kind < 0.08:  # a proper name, transliterated
            name = self.pick("name")
            return [name], [acc(name.lower().translate(_TRANSLIT).capitalize())], "3sg"
        if kind < 0.26 and modifier is None:  # a pronoun
            person, obj, tgt = _PRONOUNS[pron := r.choice(list(_PRONOUNS))]
            return [pron if case == "nom" else obj], [acc(tgt)], person
        plural, (sg, pl, noun_t) = r.random() < 0.35, self.pick("noun")
        n_adj, adjs = (
            r.choices((0, 1, 2), (55, 38, 7))[0],
            {},
        )  # an ordered set: distinct adjectives
        while len(adjs) < n_adj:
            adjs[self.pick("adj")] = None
        dets = _DETS_PL if plural else _DETS_SG
        # det_s "" is no determiner: sentence() drops empty words.
        det_s, _, det_t = r.choices(dets, [d[1] for d in dets])[0]
        src = [det_s] + [a[0] for a in adjs] + [pl if plural else sg]
        if det_s == "a" and src[1][0] in "aeiou":
            src[0] = "an"  # English agreement with the next sound
        # Target: noun + plural + case, then the adjectives mirrored and agreeing (plural: "-li",
        # "-n"), then the determiner.
        li, n, person = ("li", "n", "3pl") if plural else ("", "", "3sg")
        tgt = [acc(noun_t + li)] + [a[1] + n for a in reversed(adjs)] + [det_t]
        if modifier == "pp":  # "the dog in the garden": the PP goes before the noun
            p_src, p_tgt = self.prep_phrase()
            src, tgt = src + p_src, p_tgt + tgt
        elif modifier == "rel":  # "the dog that sees the cat": head, ke, O V
            r_src, r_tgt, _ = self.verb_phrase(person)
            src, tgt = src + ["that"] + r_src, tgt + ["ke"] + r_tgt
        return src, tgt, person

    def prep_phrase(self):
        prep = self.rng.choice(list(_PREPOSITIONS))
        np_src, np_tgt, _ = self.noun_phrase("obl")
        return [prep] + np_src, np_tgt + [_PREPOSITIONS[prep]]

    def verb_phrase(self, person, obj_modifier=None):
        """(src, tgt, tense): source V (O), target (O) V, "ma" before a negated verb."""
        r = self.rng
        tense, negated = r.choices(("pres", "past", "fut"), (50, 30, 20))[0], r.random() < 0.1
        if r.random() < 0.75:
            base, s3, past, stem = self.pick("trans")
            o_src, o_tgt, _ = self.noun_phrase("acc", obj_modifier)
        else:
            (base, s3, past, stem), o_src, o_tgt = self.pick("intrans"), [], []
        if tense == "fut":
            v_src = ["will", "not", base] if negated else ["will", base]
        elif negated:
            v_src = ["did" if tense == "past" else "does" if person == "3sg" else "do", "not", base]
        else:
            v_src = [past if tense == "past" else s3 if person == "3sg" else base]
        v_tgt = stem + _TENSE_SUFFIX[tense] + _PERSON_SUFFIX[person]
        return v_src + o_src, o_tgt + (["ma", v_tgt] if negated else [v_tgt]), tense

    def clause(self):
        r = self.rng
        subj_mod, obj_rel = r.choices((None, "pp", "rel"), (76, 12, 12))[0], r.random() < 0.12
        s_src, s_tgt, person = self.noun_phrase("nom", subj_mod)
        vp_src, vp_tgt, tense = self.verb_phrase(person, "rel" if obj_rel else None)
        # A place phrase and a time adverb, neither with a relative clause on the object: both at
        # the end of the source; in the target, the place phrase after the subject, the time adverb
        # in front.
        p_src, p_tgt = self.prep_phrase() if not obj_rel and r.random() < 0.35 else ([], [])
        t_src, t_tgt = r.choice(_TIMES[tense]) if not obj_rel and r.random() < 0.2 else ("", "")
        return s_src + vp_src + p_src + t_src.split(), t_tgt.split() + s_tgt + p_tgt + vp_tgt

    def sentence(self):
        src, tgt = self.clause()
        if self.rng.random() < 0.12:  # two clauses, joined by "and" ("i")
            src2, tgt2 = self.clause()
            src, tgt = src + ["and"] + src2, tgt + ["i"] + tgt2
        # A "" word (no determiner) is left out.
        return tuple(" ".join(w for w in words + ["."] if w) for words in (src, tgt))


def make_toy_corpus(out_dir=TOY_DIR, seed=1, n_train=20000, n_dev=500, n_test=500):
    """Writes {train,dev,test}.{src,tgt} into out_dir (a Path, returned; default data/toy/), unless
    its stamp file says they were made with these settings (so the default builds the built-in
    corpus if it is missing). Deterministic in (seed, sizes); sentences have 4 to 25 source tokens
    and are unique across the splits, so dev and test hold no training sentence."""
    out_dir = Path(out_dir)
    stamp = dict(version=TOY_VERSION, seed=seed, n_train=n_train, n_dev=n_dev, n_test=n_test)
    stamp_path, files = out_dir / "toy_corpus.json", corpus_paths(out_dir, "src", "tgt")
    all_there = all(f.exists() for fs in files.values() for f in fs)
    with contextlib.suppress(OSError, ValueError):  # no stamp, or a damaged one: rebuild
        if all_there and json.loads(stamp_path.read_text()) == stamp:
            return out_dir
    # Source -> target, in order: each source once.
    grammar, pairs = _ToyGrammar(random.Random(seed)), {}
    while len(pairs) < n_train + n_dev + n_test:
        src, tgt = grammar.sentence()
        if 4 <= len(src.split()) <= 25:
            pairs.setdefault(src, tgt)
    bounds = [0, *itertools.accumulate((n_train, n_dev, n_test))]  # split k: bounds[k : k + 2]
    texts = {
        path: "".join(p[side] + "\n" for p in itertools.islice(pairs.items(), a, b))
        for paths, (a, b) in zip(files.values(), itertools.pairwise(bounds), strict=True)
        for side, path in enumerate(paths)
    }
    # The stamp last: it is renamed in after every file.
    atomic_write_all(texts | {stamp_path: json.dumps(stamp) + "\n"})
    return out_dir


def summary():
    """python data.py: build the built-in corpus and print what it is like."""
    d, t_make = timed(make_toy_corpus)  # machinery/speed.py
    splits = {s: data.read_parallel(*p)[0] for s, p in corpus_paths(d, "src", "tgt").items()}
    print(
        f"toy corpus in {d} ({t_make:.1f}s): "
        + ", ".join(f"{s} {len(p)} pairs" for s, p in splits.items())
    )
    train = splits["train"]
    for side, name in ((0, "src"), (1, "tgt")):
        counts = Counter(w for p in train for w in p[side].split())
        rare = sum(1 for c in counts.values() if c <= 2)
        print(
            f"  {name}: {sum(counts.values()) / len(train):.1f} words/sentence, "
            f"{len(counts)} types, {rare} of them seen once or twice"
        )
    src, tgt = [p[0] for p in train], [p[1] for p in train]
    tok, t_bpe = timed(lambda: data.Tokenizer(data.train_bpe(src, tgt, 2000)))
    enc, t_enc = timed(lambda: data.encode_pairs(tok, train))
    L = data.length_percentile(enc)
    pad = data.padding_share(enc, data.make_batches(enc, 4096, shuffle=True, seed=1))
    print(
        f"  BPE: {tok.vocab_size} pieces ({t_bpe + t_enc:.1f}s to train and encode), "
        f"L(97.5%) = {L:.1f}, QKNorm's L (its g0: model.qk_g0), padding at 4096 tokens {pad:.1%}"
    )
    for s, t in train[:3]:
        print(f"  src: {s}\n  tgt: {t}")
