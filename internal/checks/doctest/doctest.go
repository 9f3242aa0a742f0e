// Package doctest reads the walkthroughs out of the Markdown docs so a test
// can run them: it finds the ```sh blocks a reader types and the output
// block shown after each, keeps the explicit skips the doc gives reasons
// for, and compares what really printed with what the doc shows after
// normalising what differs from run to run (ids, times, ports, paths,
// hashes).
//
// Markers, as HTML comments the rendered page hides:
//
//	<!-- walkthrough: NAME -->   the blocks from here on belong to NAME
//	<!-- walkthrough-end -->     ends the current walkthrough
//	<!-- skip: REASON -->        the next block is not run (or not compared)
//
// Inside a walkthrough every fenced block is accounted for: a ```sh block is
// run, a plain block right after it is its output, and any other block needs
// a skip with a reason. Outside one, every ```sh block needs a skip.
package doctest

import (
	"fmt"
	"regexp"
	"strings"
)

// Block is one fenced block of a Markdown file.
type Block struct {
	File        string
	Line        int // 1-based line of the opening fence
	Lang        string
	Text        string
	Walkthrough string // the walkthrough it belongs to, "" outside one
	Skip        string // the reason of a <!-- skip: … --> before it
	// Output is the plain block shown right after a ```sh block, if any.
	Output *Block
}

// Where names the block for a failure message.
func (b Block) Where() string { return fmt.Sprintf("%s:%d", b.File, b.Line) }

var (
	markerRE = regexp.MustCompile(`^<!--\s*(walkthrough-end|walkthrough|skip)\s*:?\s*(.*?)\s*-->$`)
)

// Parse returns the sh blocks (with their outputs attached) and the other
// blocks of md. It fails on a block a walkthrough does not account for, a
// sh block outside a walkthrough without a skip, or an empty skip reason.
func Parse(file, md string) ([]Block, error) { return parse(file, md, true) }

// ParseWalkthroughs is Parse for a doc not yet marked up outside its
// walkthroughs: a sh block outside one is kept, unrun, without an error.
func ParseWalkthroughs(file, md string) ([]Block, error) { return parse(file, md, false) }

func parse(file, md string, strict bool) ([]Block, error) {
	lines := strings.Split(md, "\n")
	var (
		out        []Block
		walk, skip string
		skipSet    bool
		lastSh     = -1 // index in out of the sh block the next plain block may belong to
	)
	for i := 0; i < len(lines); i++ {
		l := strings.TrimSpace(lines[i])
		if m := markerRE.FindStringSubmatch(l); m != nil {
			switch m[1] {
			case "walkthrough":
				walk = m[2]
			case "walkthrough-end":
				walk = ""
			case "skip":
				if m[2] == "" {
					return nil, fmt.Errorf("%s:%d: a skip needs a reason", file, i+1)
				}
				skip, skipSet = m[2], true
			}
			lastSh = -1
			continue
		}
		if !strings.HasPrefix(l, "```") {
			if l != "" {
				lastSh = -1
			}
			continue
		}
		b := Block{File: file, Line: i + 1, Lang: strings.TrimPrefix(l, "```"), Walkthrough: walk, Skip: skip}
		var body []string
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			body = append(body, lines[i])
		}
		if i == len(lines) {
			return nil, fmt.Errorf("%s: unclosed fence", b.Where())
		}
		b.Text = strings.Join(body, "\n")
		wasSkip := skipSet
		skip, skipSet = "", false
		if b.Lang == "" && lastSh >= 0 && !wasSkip {
			b.Skip = out[lastSh].Skip
			o := b
			out[lastSh].Output = &o
			lastSh = -1
			continue
		}
		switch {
		case b.Lang == "sh" && (walk != "" || wasSkip):
		case b.Lang == "sh" && strict:
			return nil, fmt.Errorf("%s: a sh block outside a walkthrough needs <!-- skip: reason -->", b.Where())
		case walk != "" && !wasSkip:
			return nil, fmt.Errorf("%s: a block in walkthrough %q that is neither run, its output nor skipped with a reason", b.Where(), walk)
		}
		out = append(out, b)
		lastSh = -1
		if b.Lang == "sh" {
			// A skipped command's output block is skipped with it.
			lastSh = len(out) - 1
		}
	}
	return out, nil
}

// Section returns the sh blocks of md's section under the heading whose
// text is heading (any level), up to the next heading of that level or
// above, skipped ones included: a test that runs a section as written
// finds it by its heading, whatever file it moved to. ok is false when md
// has no such heading.
func Section(md string, blocks []Block, heading string) (out []Block, ok bool) {
	start, end, level := 0, 0, 0
	fence := false
	for i, l := range strings.Split(md, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			fence = !fence
		}
		n := len(l) - len(strings.TrimLeft(l, "#"))
		if fence || n == 0 || !strings.HasPrefix(l[n:], " ") {
			continue
		}
		switch {
		case start == 0 && strings.TrimSpace(l[n:]) == heading:
			start, level = i+1, n
		case start != 0 && n <= level:
			end = i + 1
		}
		if end != 0 {
			break
		}
	}
	if start == 0 {
		return nil, false
	}
	for _, b := range blocks {
		if b.Lang == "sh" && b.Line > start && (end == 0 || b.Line < end) {
			out = append(out, b)
		}
	}
	return out, true
}

// Walkthrough returns the blocks of one walkthrough that are run, in order.
func Walkthrough(blocks []Block, name string) []Block {
	var out []Block
	for _, b := range blocks {
		if b.Walkthrough == name && b.Lang == "sh" && b.Skip == "" {
			out = append(out, b)
		}
	}
	return out
}

// heredocRE finds a here-document's delimiter: <<WORD, <<'WORD', <<-"WORD".
var heredocRE = regexp.MustCompile(`(?:^|[^<])<<-?\s*['"]?([A-Za-z_][A-Za-z0-9_]*)['"]?`)

// Commands splits a sh block into the commands a reader types: comments
// dropped, backslash continuations joined, one command a line; a
// here-document's lines, up to its delimiter, stay with its command.
func Commands(text string) []string {
	var out []string
	cur := ""
	lines := strings.Split(text, "\n")
	for i := 0; i < len(lines); i++ {
		t := strings.TrimRight(lines[i], " \t")
		if m := heredocRE.FindStringSubmatch(stripComment(t)); m != nil && !strings.HasSuffix(t, "\\") {
			doc := []string{strings.TrimSpace(cur + t)}
			for i++; i < len(lines); i++ {
				doc = append(doc, lines[i])
				if strings.TrimSpace(lines[i]) == m[1] {
					break
				}
			}
			out = append(out, strings.Join(doc, "\n"))
			cur = ""
			continue
		}
		if strings.HasSuffix(t, "\\") {
			cur += strings.TrimSuffix(t, "\\")
			continue
		}
		cur += t
		if c := strings.TrimSpace(stripComment(cur)); c != "" {
			out = append(out, c)
		}
		cur = ""
	}
	return out
}

// stripComment drops a trailing "# …" that is outside quotes and starts a word.
func stripComment(s string) string {
	var quote rune
	for i, r := range s {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
		case r == '\'' || r == '"':
			quote = r
		case r == '#' && (i == 0 || s[i-1] == ' ' || s[i-1] == '\t'):
			return s[:i]
		}
	}
	return s
}

// Background reports whether a command ends with a lone & (runs in the
// background) and returns it without the &.
func Background(cmd string) (string, bool) {
	t := strings.TrimSpace(cmd)
	if strings.HasSuffix(t, "&") && !strings.HasSuffix(t, "&&") {
		return strings.TrimSpace(strings.TrimSuffix(t, "&")), true
	}
	return t, false
}
