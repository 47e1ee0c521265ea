/* The host tier's bookkeeping where it runs per chunk, natively:
 *
 * - LruSlots: the host primary tier's per-key work under the built-in LRU policy, in one
 *   pass per call;
 * - HitPath: a lookup's answer for a chunk readable in host memory, without a Python frame
 *   (TieringManager.hit_path).
 *
 * LruSlots: the primary tier's per-key work under the built-in LRU policy.
 *
 * Built at install time by hatch_build.py when a C compiler and Python's headers are there;
 * kvhex.domain.primary uses it for a tier whose policy is exactly LruPolicy and falls back to
 * its Python path (index dict, ref-count list, SlotPool, policy object) otherwise. Both paths
 * give the same answers, slots, victims and orders (tests/domain/test_primary_native.py
 * drives both with the same operations and compares every result).
 *
 * The tier's index (dict: key -> slot) and ref counts (list: slot -> -1 pending, 0 evictable,
 * > 0 pinned) stay Python objects that this code updates in place, so the tiering manager's
 * hot-path view of them (PrimaryTier.read_view) is the same on both paths. This object owns
 * the rest: the recency order (a doubly linked list over slots, oldest first, holding every
 * resident slot: pending, evictable and pinned alike, as LruPolicy's ordered dict does), the
 * key of each slot, the free slots (fresh ids increasing, then freed ids last-in first-out:
 * SlotPool's contract) and each pending write's offer sequence number.
 *
 * An LRU key's state is its ref count's sign, so the policy calls that only change a state
 * (mark_pinned, mark_evictable) cost nothing here. Python keeps the counters, the events and
 * the typed errors: a call that meets a key it cannot handle changes nothing and returns the
 * key's position, which Python turns into the error the Python path raises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define API_VERSION 2
#define NONE (-1)
#define SCAN_MAX 16 /* candidates compared one by one before a set is built */

/* What this object keeps of one slot, together: a slot's work reads one cache line. */
typedef struct {
    Py_ssize_t prev;    /* recency links; NONE ends the list */
    Py_ssize_t next;
    PyObject *key;      /* a strong reference, or NULL when the slot is free */
    long long offered;  /* the offer sequence number of its pending write */
} SlotEntry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;      /* slots */
    PyObject *index;   /* dict: key -> slot (shared with PrimaryTier) */
    PyObject *refs;    /* list: slot -> ref count (shared with PrimaryTier) */
    SlotEntry *slot;   /* per slot */
    PyObject **ints;   /* slot -> its number as an int object, made once: the index's values
                        * and the slot lists returned share them (no allocation per key, and
                        * the values a lookup reads lie together) */
    Py_ssize_t head;   /* oldest resident slot */
    Py_ssize_t tail;   /* most recent */
    Py_ssize_t resident;
    Py_ssize_t *free;  /* freed slots, the last freed on top */
    Py_ssize_t free_top;
    Py_ssize_t next_fresh;
} Slots;

/* -- helpers ------------------------------------------------------------------------------ */

/* 0, or -1 with an exception: the object was never initialized, or the ref-count list it
 * shares no longer has one entry per slot. Every method that reads the tables checks. */
static int check_shared(Slots *self) {
    if (self->slot == NULL || self->refs == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LruSlots is not initialized");
        return -1;
    }
    if (!PyList_CheckExact(self->refs) || PyList_GET_SIZE(self->refs) != self->n) {
        PyErr_SetString(PyExc_RuntimeError, "the ref-count list was resized or replaced");
        return -1;
    }
    return 0;
}

static long ref_of(Slots *self, Py_ssize_t slot) {
    return PyLong_AsLong(PyList_GET_ITEM(self->refs, slot));
}

static int set_ref(Slots *self, Py_ssize_t slot, long value) {
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL) return -1;
    PyObject *old = PyList_GET_ITEM(self->refs, slot);
    PyList_SET_ITEM(self->refs, slot, v);
    Py_DECREF(old);
    return 0;
}

/* The slot of `key`: >= 0; -1 absent; -2 an error is set (unhashable key). */
static Py_ssize_t slot_of(Slots *self, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(self->index, key);
    if (v == NULL) return PyErr_Occurred() ? -2 : -1;
    Py_ssize_t slot = PyLong_AsSsize_t(v);
    if (slot < 0 || slot >= self->n) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the index holds a slot out of range");
        return -2;
    }
    return slot;
}

static void unlink_slot(Slots *self, Py_ssize_t s) {
    Py_ssize_t p = self->slot[s].prev, q = self->slot[s].next;
    if (p == NONE) self->head = q; else self->slot[p].next = q;
    if (q == NONE) self->tail = p; else self->slot[q].prev = p;
    self->slot[s].prev = self->slot[s].next = NONE;
}

static void link_tail(Slots *self, Py_ssize_t s) {
    self->slot[s].prev = self->tail;
    self->slot[s].next = NONE;
    if (self->tail == NONE) self->head = s; else self->slot[self->tail].next = s;
    self->tail = s;
}

/* Forget the key of resident slot `s` (index entry, links, key) and free the slot. */
static int drop_slot(Slots *self, Py_ssize_t s) {
    PyObject *key = self->slot[s].key;
    if (PyDict_DelItem(self->index, key) < 0) return -1;
    unlink_slot(self, s);
    self->slot[s].key = NULL;
    Py_DECREF(key);
    self->free[self->free_top++] = s;
    self->resident--;
    return 0;
}

static PyObject *slot_list(Slots *self, Py_ssize_t *slots, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(out, i, Py_NewRef(self->ints[slots[i]]));
    return out;
}

/* The keys of `seq` to iterate (PySequence_Fast_GET_ITEM): a tuple as it is, a list as it is
 * when every key is exact bytes (looking those up runs no Python code, so nothing can change
 * the list meanwhile), anything else copied into a tuple. A new reference, or NULL. */
static PyObject *key_items(PyObject *seq) {
    if (PyTuple_CheckExact(seq)) return Py_NewRef(seq);
    if (PyList_CheckExact(seq)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(seq); i++) {
            if (!PyBytes_CheckExact(PyList_GET_ITEM(seq, i))) return PySequence_Tuple(seq);
        }
        return Py_NewRef(seq);
    }
    return PySequence_Tuple(seq);
}

/* 0 when a method called with positional arguments only got `want` of them; else -1 with a
 * TypeError naming it. */
static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, want,
                 nargs);
    return -1;
}

/* -- lifecycle ---------------------------------------------------------------------------- */

static void Slots_release(Slots *self) {
    if (self->slot != NULL) {
        for (Py_ssize_t s = 0; s < self->n; s++) {
            Py_CLEAR(self->slot[s].key);
            self->slot[s].prev = self->slot[s].next = NONE;
        }
    }
    self->head = self->tail = NONE;
    self->resident = 0;
    self->free_top = 0;
    self->next_fresh = 0;
}

static void Slots_dealloc(Slots *self) {
    Slots_release(self);
    if (self->ints != NULL) {
        for (Py_ssize_t s = 0; s < self->n; s++) Py_XDECREF(self->ints[s]);
    }
    PyMem_Free(self->slot);
    PyMem_Free(self->ints);
    PyMem_Free(self->free);
    Py_XDECREF(self->index);
    Py_XDECREF(self->refs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Slots_init(Slots *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"num_slots", "index", "refs", NULL};
    Py_ssize_t n;
    PyObject *index, *refs;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nO!O!", names, &n, &PyDict_Type, &index,
                                     &PyList_Type, &refs))
        return -1;
    if (self->slot != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LruSlots is initialized once");
        return -1;
    }
    if (n < 0 || PyList_GET_SIZE(refs) != n || PyDict_GET_SIZE(index) != 0) {
        PyErr_SetString(PyExc_ValueError, "needs an empty index and one ref count per slot");
        return -1;
    }
    size_t m = n ? (size_t)n : 1;
    SlotEntry *slot = PyMem_Calloc(m, sizeof(SlotEntry));
    PyObject **ints = PyMem_Calloc(m, sizeof(PyObject *));
    Py_ssize_t *free_slots = PyMem_Calloc(m, sizeof(Py_ssize_t));
    if (!slot || !ints || !free_slots) {
        PyMem_Free(slot);
        PyMem_Free(ints);
        PyMem_Free(free_slots);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t s = 0; s < n; s++) {
        if ((ints[s] = PyLong_FromSsize_t(s)) == NULL) {
            while (s > 0) Py_DECREF(ints[--s]);
            PyMem_Free(slot);
            PyMem_Free(ints);
            PyMem_Free(free_slots);
            return -1;
        }
    }
    self->slot = slot;
    self->ints = ints;
    self->free = free_slots;
    self->n = n;
    Py_INCREF(index);
    self->index = index;
    Py_INCREF(refs);
    self->refs = refs;
    Slots_release(self);
    return 0;
}

/* -- loads and pins ----------------------------------------------------------------------- */

static void undo_pins(Slots *self, Py_ssize_t *slots, Py_ssize_t done, long delta) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *raised = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
#endif
    for (Py_ssize_t i = 0; i < done; i++) {
        if (set_ref(self, slots[i], ref_of(self, slots[i]) + delta) < 0) PyErr_Clear();
    }
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(raised);
#else
    PyErr_Restore(type, value, trace);
#endif
}

/* repin(keys, delta) -> (slots, crossed): each key's ref count moved by delta (pins taken
 * when > 0, released when < 0), and how many counts crossed zero (newly pinned, or freed) |
 * position of the first key that is absent, unhashable, pending or has fewer than -delta
 * pins (nothing changed). A key listed twice moves twice. */
static PyObject *Slots_repin(Slots *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("repin", nargs, 2) < 0) return NULL;
    long delta = PyLong_AsLong(args[1]);
    if (delta == -1 && PyErr_Occurred()) return NULL;
    if (delta == 0) {
        PyErr_SetString(PyExc_ValueError, "delta must not be 0");
        return NULL;
    }
    if (check_shared(self) < 0) return NULL;
    PyObject *keys = key_items(args[0]);
    if (keys == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), crossed = 0, i;
    Py_ssize_t *slots = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        Py_ssize_t s = slot_of(self, PySequence_Fast_GET_ITEM(keys, i));
        long count = s >= 0 ? ref_of(self, s) : -1;
        if (s < 0 || count < 0 || count + delta < 0) {
            if (s == -2 && !PyErr_ExceptionMatches(PyExc_TypeError)) {
                undo_pins(self, slots, i, -delta);
                goto done;
            }
            PyErr_Clear(); /* unhashable: the caller names it */
            undo_pins(self, slots, i, -delta);
            out = PyLong_FromSsize_t(i);
            goto done;
        }
        if ((count == 0) != (count + delta == 0)) crossed++;
        if (set_ref(self, s, count + delta) < 0) {
            undo_pins(self, slots, i, -delta);
            goto done;
        }
        slots[i] = s;
    }
    PyObject *list = slot_list(self, slots, n);
    if (list != NULL) {
        PyObject *count = PyLong_FromSsize_t(crossed);
        if (count != NULL) out = PyTuple_Pack(2, list, count);
        Py_XDECREF(count);
        Py_DECREF(list);
    }
done:
    PyMem_Free(slots);
    Py_DECREF(keys);
    return out;
}

/* touch(keys): the resident ones most recent, the first key last (so it ends most recent);
 * keys not resident, unhashable ones included, are ignored. */
static PyObject *Slots_touch(Slots *self, PyObject *seq) {
    if (check_shared(self) < 0) return NULL;
    PyObject *keys = key_items(seq);
    if (keys == NULL) return NULL;
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(keys) - 1; i >= 0; i--) {
        Py_ssize_t s = slot_of(self, PySequence_Fast_GET_ITEM(keys, i));
        if (s == -2) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                Py_DECREF(keys);
                return NULL;
            }
            PyErr_Clear();
            continue;
        }
        if (s >= 0 && self->tail != s) {
            unlink_slot(self, s);
            link_tail(self, s);
        }
    }
    Py_DECREF(keys);
    Py_RETURN_NONE;
}

/* -- stores ------------------------------------------------------------------------------- */

/* The keys of the tuple `keys` not resident, each once, in offered order; NULL with no
 * exception set and *bad the position of the first key that is not bytes of `length`. */
static PyObject *find_candidates(Slots *self, PyObject *keys, Py_ssize_t length,
                                 Py_ssize_t *bad) {
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    PyObject *out = PyList_New(0), *seen = NULL;
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != length) {
            *bad = i;
            goto fail;
        }
        int found = PyDict_Contains(self->index, key);
        if (found < 0) goto fail;
        if (found) continue;
        /* listed twice? a scan of the few candidates so far, a set past SCAN_MAX */
        Py_ssize_t m = PyList_GET_SIZE(out);
        if (m == SCAN_MAX && seen == NULL) {
            seen = PySet_New(out);
            if (seen == NULL) goto fail;
        }
        int dup = 0;
        if (seen != NULL) {
            dup = PySet_Contains(seen, key);
            if (dup == 0) dup = PySet_Add(seen, key);
        } else {
            for (Py_ssize_t j = 0; j < m && dup == 0; j++) {
                PyObject *other = PyList_GET_ITEM(out, j);
                dup = other == key || (PyBytes_GET_SIZE(other) == length &&
                                       memcmp(PyBytes_AS_STRING(other),
                                              PyBytes_AS_STRING(key), (size_t)length) == 0);
            }
        }
        if (dup < 0) goto fail;
        if (dup) continue;
        if (PyList_Append(out, key) < 0) goto fail;
    }
    Py_XDECREF(seen);
    return out;
fail:
    Py_DECREF(out);
    Py_XDECREF(seen);
    return NULL;
}

/* The `want` oldest evictable keys not in `protected`, forgotten and their slots freed in
 * that order; None (a new reference) when fewer exist, nothing changed; NULL on error. */
static PyObject *evict_oldest(Slots *self, Py_ssize_t want, PyObject *protected) {
    if (want <= 0) return PyList_New(0);
    if (want > self->resident) return Py_NewRef(Py_None);
    Py_ssize_t *chosen = PyMem_Malloc((size_t)want * sizeof(Py_ssize_t)), found = 0;
    if (chosen == NULL) return PyErr_NoMemory();
    PyObject *victims = NULL;
    for (Py_ssize_t s = self->head; s != NONE && found < want; s = self->slot[s].next) {
        if (ref_of(self, s) != 0) continue;
        int kept = PySequence_Contains(protected, self->slot[s].key);
        if (kept < 0) goto done;
        if (!kept) chosen[found++] = s;
    }
    if (found < want) {
        victims = Py_NewRef(Py_None);
        goto done;
    }
    victims = PyList_New(want);
    if (victims == NULL) goto done;
    for (Py_ssize_t i = 0; i < want; i++) {
        PyList_SET_ITEM(victims, i, Py_NewRef(self->slot[chosen[i]].key));
        if (drop_slot(self, chosen[i]) < 0) {
            Py_CLEAR(victims);
            goto done;
        }
    }
done:
    PyMem_Free(chosen);
    return victims;
}

/* Slots for the keys of the list or tuple `keys`: fresh ids first (increasing), then the
 * last freed; each key indexed, its write pending, most recent in the order given, its
 * offer numbered from `number`. The caller checked that they fit and that none is resident. */
static PyObject *place_keys(Slots *self, PyObject *keys, long long number) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (n > self->n - self->next_fresh + self->free_top) {
        PyErr_Format(PyExc_ValueError, "cannot allocate %zd slots", n);
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        Py_ssize_t s = self->next_fresh < self->n ? self->next_fresh++ : self->free[--self->free_top];
        PyObject *v = self->ints[s];
        if (PyDict_SetItem(self->index, key, v) < 0 || set_ref(self, s, -1) < 0) {
            /* the slot is back on the free list; earlier keys stay (an out-of-memory state) */
            self->free[self->free_top++] = s;
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, Py_NewRef(v));
        Py_INCREF(key);
        self->slot[s].key = key;
        self->slot[s].offered = number + i;
        link_tail(self, s);
        self->resident++;
    }
    return out;
}

/* candidates(keys, key_length) -> the keys not resident, each once, in offered order |
 * position of the first key that is not bytes of key_length (-1: no length known yet). */
static PyObject *Slots_candidates(Slots *self, PyObject *args) {
    PyObject *seq;
    Py_ssize_t length, bad = -1;
    if (!PyArg_ParseTuple(args, "On", &seq, &length)) return NULL;
    if (check_shared(self) < 0) return NULL;
    PyObject *keys = PySequence_Tuple(seq);
    if (keys == NULL) return NULL;
    PyObject *out = find_candidates(self, keys, length, &bad);
    Py_DECREF(keys);
    if (out == NULL && bad >= 0) return PyLong_FromSsize_t(bad);
    return out;
}

/* evict(n, protected) -> the n oldest evictable keys not in `protected` (forgotten, their
 * slots freed in that order) | None when fewer exist (nothing changed). */
static PyObject *Slots_evict(Slots *self, PyObject *args) {
    Py_ssize_t want;
    PyObject *protected;
    if (!PyArg_ParseTuple(args, "nO", &want, &protected)) return NULL;
    if (check_shared(self) < 0) return NULL;
    return evict_oldest(self, want, protected);
}

/* insert(keys, seq) -> their slots (see place_keys). */
static PyObject *Slots_insert(Slots *self, PyObject *args) {
    PyObject *seq;
    long long number;
    if (!PyArg_ParseTuple(args, "OL", &seq, &number)) return NULL;
    if (check_shared(self) < 0) return NULL;
    PyObject *keys = PySequence_Tuple(seq);
    if (keys == NULL) return NULL;
    PyObject *out = place_keys(self, keys, number);
    Py_DECREF(keys);
    return out;
}

/* store(keys, key_length, evictable, protect, seq) -> (candidates, slots, victims): the
 * candidates (as candidates() finds them) placed (as insert() places them) after evicting
 * (as evict() does) what they need, never a key of `keys` or `protect` | (candidates, None,
 * None) when even eviction cannot make room (`evictable`: the keys that may be evicted;
 * nothing changed) | position of the first key that is not bytes of key_length (nothing
 * changed). */
static PyObject *Slots_store(Slots *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("store", nargs, 5) < 0) return NULL;
    PyObject *protect = args[3];
    Py_ssize_t length = PyLong_AsSsize_t(args[1]), bad = -1;
    if (length == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t evictable = PyLong_AsSsize_t(args[2]);
    if (evictable == -1 && PyErr_Occurred()) return NULL;
    long long number = PyLong_AsLongLong(args[4]);
    if (number == -1 && PyErr_Occurred()) return NULL;
    if (check_shared(self) < 0) return NULL;
    PyObject *keys = PySequence_Tuple(args[0]);
    if (keys == NULL) return NULL;
    PyObject *out = NULL, *slots = NULL, *victims = NULL, *protected = NULL;
    PyObject *candidates = find_candidates(self, keys, length, &bad);
    if (candidates == NULL) {
        if (bad >= 0) out = PyLong_FromSsize_t(bad);
        goto done;
    }
    Py_ssize_t need = PyList_GET_SIZE(candidates) - (self->n - self->next_fresh + self->free_top);
    if (need > 0) {
        if (need > evictable) {
            out = PyTuple_Pack(3, candidates, Py_None, Py_None);
            goto done;
        }
        int more = PyObject_IsTrue(protect);
        if (more < 0) goto done;
        if (!more && PyTuple_GET_SIZE(keys) <= SCAN_MAX) { /* a few keys: scanned */
            protected = Py_NewRef(keys);
        } else if ((protected = PySet_New(keys)) == NULL) {
            goto done;
        }
        if (more) {
            PyObject *it = PyObject_GetIter(protect), *item;
            if (it == NULL) goto done;
            while ((item = PyIter_Next(it)) != NULL) {
                int added = PySet_Add(protected, item);
                Py_DECREF(item);
                if (added < 0) break;
            }
            Py_DECREF(it);
            if (PyErr_Occurred()) goto done;
        }
        victims = evict_oldest(self, need, protected);
        if (victims == NULL) goto done;
        if (victims == Py_None) {
            out = PyTuple_Pack(3, candidates, Py_None, Py_None);
            goto done;
        }
    } else {
        victims = PyList_New(0);
        if (victims == NULL) goto done;
    }
    slots = place_keys(self, candidates, number);
    if (slots == NULL) goto done;
    out = PyTuple_Pack(3, candidates, slots, victims);
done:
    Py_XDECREF(candidates);
    Py_XDECREF(slots);
    Py_XDECREF(victims);
    Py_XDECREF(protected);
    Py_DECREF(keys);
    return out;
}

typedef struct {
    long long offered;
    PyObject *key;
} ordered_key;

static int by_offer(const void *a, const void *b) {
    long long x = ((const ordered_key *)a)->offered, y = ((const ordered_key *)b)->offered;
    return (x > y) - (x < y);
}

/* complete(keys, pin) -> the listed keys whose write was pending, each now at `pin` pins,
 * in the order they were offered. */
static PyObject *Slots_complete(Slots *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("complete", nargs, 2) < 0) return NULL;
    long pin = PyLong_AsLong(args[1]);
    if (pin == -1 && PyErr_Occurred()) return NULL;
    if (check_shared(self) < 0) return NULL;
    PyObject *keys = key_items(args[0]);
    if (keys == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), m = 0;
    ordered_key *done = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(ordered_key));
    PyObject *out = NULL;
    if (done == NULL) {
        PyErr_NoMemory();
        goto finish;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = slot_of(self, PySequence_Fast_GET_ITEM(keys, i));
        if (s == -2) goto finish;
        if (s < 0 || ref_of(self, s) != -1) continue;
        if (set_ref(self, s, pin) < 0) goto finish;
        done[m].offered = self->slot[s].offered;
        done[m].key = self->slot[s].key;
        m++;
    }
    if (m > 1) qsort(done, (size_t)m, sizeof(ordered_key), by_offer);
    out = PyList_New(m);
    if (out == NULL) goto finish;
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_INCREF(done[i].key);
        PyList_SET_ITEM(out, i, done[i].key);
    }
finish:
    PyMem_Free(done);
    Py_DECREF(keys);
    return out;
}

/* fail(keys) -> the listed keys whose write was pending, forgotten and their slots freed. */
static PyObject *Slots_fail(Slots *self, PyObject *seq) {
    if (check_shared(self) < 0) return NULL;
    PyObject *keys = key_items(seq);
    if (keys == NULL) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keys); i++) {
        Py_ssize_t s = slot_of(self, PySequence_Fast_GET_ITEM(keys, i));
        if (s == -2) goto fail;
        if (s < 0 || ref_of(self, s) != -1) continue;
        if (PyList_Append(out, self->slot[s].key) < 0 || set_ref(self, s, 0) < 0 ||
            drop_slot(self, s) < 0)
            goto fail;
    }
    Py_DECREF(keys);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(keys);
    return NULL;
}

/* reset(): every slot free, fresh ids from 0 again, the order empty (the caller clears the
 * index and the ref counts). */
static PyObject *Slots_reset(Slots *self, PyObject *Py_UNUSED(ignored)) {
    Slots_release(self);
    Py_RETURN_NONE;
}

/* order() -> the resident keys, oldest first (for tests and operators). */
static PyObject *Slots_order(Slots *self, PyObject *Py_UNUSED(ignored)) {
    if (check_shared(self) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t s = self->head; s != NONE; s = self->slot[s].next) {
        if (PyList_Append(out, self->slot[s].key) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *Slots_free_count(Slots *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->n - self->next_fresh + self->free_top);
}

static Py_ssize_t Slots_len(Slots *self) { return self->resident; }

static PyMethodDef Slots_methods[] = {
    {"repin", (PyCFunction)(void (*)(void))Slots_repin, METH_FASTCALL, NULL},
    {"touch", (PyCFunction)Slots_touch, METH_O, NULL},
    {"candidates", (PyCFunction)Slots_candidates, METH_VARARGS, NULL},
    {"evict", (PyCFunction)Slots_evict, METH_VARARGS, NULL},
    {"insert", (PyCFunction)Slots_insert, METH_VARARGS, NULL},
    {"store", (PyCFunction)(void (*)(void))Slots_store, METH_FASTCALL, NULL},
    {"complete", (PyCFunction)(void (*)(void))Slots_complete, METH_FASTCALL, NULL},
    {"fail", (PyCFunction)Slots_fail, METH_O, NULL},
    {"reset", (PyCFunction)Slots_reset, METH_NOARGS, NULL},
    {"order", (PyCFunction)Slots_order, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Slots_getset[] = {
    {"free_count", (getter)Slots_free_count, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Slots_as_sequence = {
    .sq_length = (lenfunc)Slots_len,
};

static PyTypeObject SlotsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvhex.domain._hostslots.LruSlots",
    .tp_basicsize = sizeof(Slots),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Slots_init,
    .tp_dealloc = (destructor)Slots_dealloc,
    .tp_methods = Slots_methods,
    .tp_getset = Slots_getset,
    .tp_as_sequence = &Slots_as_sequence,
};

/* -- HitPath ------------------------------------------------------------------------------ */

/* HitPath(fallback, index, refs, hits, ready, idle, hit, miss=None): called as a
 * lookup(key, ctx) while the list `ready` is not empty and every container of `idle` is
 * empty, it answers `hit` and adds key to `hits` when key's slot in `index` has a ref count
 * >= 0 in `refs`, and (unless `miss` is None) answers `miss` and counts it in `misses` when
 * key is not in `index`; otherwise it returns fallback(key, ctx). The owner
 * (TieringManager.hit_path) says why these conditions make those answers its own lookup's,
 * for any request. */
typedef struct {
    PyObject_HEAD
    PyObject *fallback;
    PyObject *index;
    PyObject *refs;
    PyObject *hits;
    PyObject *ready; /* a list: not empty while the path may answer */
    PyObject *idle;  /* a tuple of sized containers */
    PyObject *hit;
    PyObject *miss;  /* NULL: misses go to the fallback */
    Py_ssize_t misses;
    vectorcallfunc vectorcall;
} HitPath;

static PyObject *HitPath_vectorcall(HitPath *self, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (self->fallback == NULL) { /* cleared by the garbage collector */
        PyErr_SetString(PyExc_RuntimeError, "HitPath is not initialized");
        return NULL;
    }
    if (nargs == 2 && kwnames == NULL && PyList_GET_SIZE(self->ready)) {
        int idle = 1;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->idle); i++) {
            PyObject *c = PyTuple_GET_ITEM(self->idle, i);
            Py_ssize_t n = PyDict_CheckExact(c) ? PyDict_GET_SIZE(c) : PyObject_Size(c);
            if (n != 0) {
                if (n < 0) PyErr_Clear();
                idle = 0;
                break;
            }
        }
        PyObject *v = idle ? PyDict_GetItemWithError(self->index, args[0]) : NULL;
        if (v != NULL) {
            Py_ssize_t slot = PyLong_AsSsize_t(v);
            if (slot >= 0 && slot < PyList_GET_SIZE(self->refs) &&
                PyLong_AsLong(PyList_GET_ITEM(self->refs, slot)) >= 0) {
                if (PySet_Add(self->hits, args[0]) < 0) return NULL;
                return Py_NewRef(self->hit);
            }
        } else if (idle && self->miss != NULL && !PyErr_Occurred()) {
            self->misses++;
            return Py_NewRef(self->miss);
        }
        if (PyErr_Occurred()) PyErr_Clear(); /* the fallback says what is wrong */
    }
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static int HitPath_init(HitPath *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"fallback", "index", "refs", "hits", "ready",
                            "idle",     "hit",   "miss", NULL};
    PyObject *fallback, *index, *refs, *hits, *ready, *idle, *hit, *miss = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!O!O!O!O|O", names, &fallback,
                                     &PyDict_Type, &index, &PyList_Type, &refs, &PySet_Type,
                                     &hits, &PyList_Type, &ready, &PyTuple_Type, &idle, &hit,
                                     &miss))
        return -1;
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return -1;
    }
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    Py_XSETREF(self->index, Py_NewRef(index));
    Py_XSETREF(self->refs, Py_NewRef(refs));
    Py_XSETREF(self->hits, Py_NewRef(hits));
    Py_XSETREF(self->ready, Py_NewRef(ready));
    Py_XSETREF(self->idle, Py_NewRef(idle));
    Py_XSETREF(self->hit, Py_NewRef(hit));
    Py_XSETREF(self->miss, miss == Py_None ? NULL : Py_NewRef(miss));
    self->misses = 0;
    self->vectorcall = (vectorcallfunc)HitPath_vectorcall;
    return 0;
}

static int HitPath_traverse(HitPath *self, visitproc visit, void *arg) {
    Py_VISIT(self->fallback);
    Py_VISIT(self->index);
    Py_VISIT(self->refs);
    Py_VISIT(self->hits);
    Py_VISIT(self->ready);
    Py_VISIT(self->idle);
    Py_VISIT(self->hit);
    Py_VISIT(self->miss);
    return 0;
}

static int HitPath_clear(HitPath *self) {
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->index);
    Py_CLEAR(self->refs);
    Py_CLEAR(self->hits);
    Py_CLEAR(self->ready);
    Py_CLEAR(self->idle);
    Py_CLEAR(self->hit);
    Py_CLEAR(self->miss);
    return 0;
}

static void HitPath_dealloc(HitPath *self) {
    PyObject_GC_UnTrack(self);
    HitPath_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *HitPath_call(HitPath *self, PyObject *args, PyObject *kwds) {
    if (self->fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "HitPath is not initialized");
        return NULL;
    }
    return PyVectorcall_Call((PyObject *)self, args, kwds);
}

static PyObject *HitPath_get_misses(HitPath *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->misses);
}

static PyGetSetDef HitPath_getset[] = {
    {"misses", (getter)HitPath_get_misses, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HitPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvhex.domain._hostslots.HitPath",
    .tp_basicsize = sizeof(HitPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(HitPath, vectorcall),
    .tp_call = (ternaryfunc)HitPath_call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)HitPath_init,
    .tp_dealloc = (destructor)HitPath_dealloc,
    .tp_traverse = (traverseproc)HitPath_traverse,
    .tp_clear = (inquiry)HitPath_clear,
    .tp_getset = HitPath_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hostslots", NULL, -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hostslots(void) {
    if (PyType_Ready(&SlotsType) < 0 || PyType_Ready(&HitPathType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0 ||
        PyModule_AddObjectRef(m, "LruSlots", (PyObject *)&SlotsType) < 0 ||
        PyModule_AddObjectRef(m, "HitPath", (PyObject *)&HitPathType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
