// Package reqcheck keeps the requirement numbers cited in the code honest:
// every number that Go code under cmd/, internal/, e2e/ or deploy/ cites
// must have an anchor in docs/requirements.md, so a link such as
// docs/requirements.md#r4-9 always lands on the promise the code claims to
// keep.
//
// The forms that count as a citation (see Extract):
//
//   - R4.9 and R10 as words in comments, strings and messages: the letter R
//     not preceded by a letter, digit or underscore, then a number, an
//     optional .number and an optional one-letter suffix (R4.9a), then
//     anything but a letter, digit, underscore or a further .digit (so a
//     version-like R1.2.3 is not a citation);
//   - R4_9 inside identifiers, after anything but a digit:
//     TestJoinRetriesLostAnswerR4_9, TestR12_1SessionRefused;
//   - each end of a range R10.1–R10.3.
//
// Not citations: R followed by a letter (RFC 7518), R inside a word
// (AES256R2, placeholderHardwareR62: an identifier must use R6_2), and R12
// inside a run of 16 or more base64 characters holding '+', '/' or '=' (a
// key or certificate in a test fixture).
//
// The test in this package walks the tree and fails with file:line for
// each citation that docs/requirements.md does not define. The package's
// own files are not scanned: its tests cite made-up numbers on purpose.
package reqcheck
