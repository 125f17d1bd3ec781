"""A fixed set of ordinary English sentences for the parity gate (written for this project).

Random token ids are out of distribution for a trained model: its int8 activation ranges, and so its
quantisation error, are different on real text. The gate checks every graph on these sentences too.
Varied topics and lengths (3 to about 60 words), some with digits, quotes and punctuation.
"""
from __future__ import annotations

SENTENCES: tuple[str, ...] = (
    "Good morning.",
    "Where is the nearest train station?",
    "The meeting has been moved to Thursday afternoon because the projector is broken.",
    "She planted tomatoes, basil and two rows of beans along the south fence.",
    "Interest rates rose again last quarter, and mortgage applications fell to their lowest level in a decade.",
    "A cat slept on the warm hood of the car while the rain stopped.",
    "Please restart the server after you have updated the configuration file.",
    "The museum's new wing displays pottery from the ninth century, most of it found during road works near the river.",
    "He ran the marathon in three hours and twelve minutes, his best time so far.",
    "Photosynthesis converts light, water and carbon dioxide into sugar and oxygen.",
    "Can you recommend a good book about the history of mathematics?",
    "The committee rejected the proposal, arguing that the budget did not account for maintenance costs over "
    "the next twenty years.",
    "Our flight was delayed by four hours, so we missed the connection in Frankfurt and spent the night at an "
    "airport hotel.",
    "Whisk the eggs with a pinch of salt, then fold in the flour slowly.",
    "The river flooded the lower town twice this spring.",
    "Researchers found that people who slept less than six hours a night were more likely to catch a cold "
    "after being exposed to the virus.",
    "I don't think that's a good idea, but let's try it anyway.",
    "The library closes at 8 p.m. on weekdays and at noon on Saturdays.",
    "A small bug in the billing code charged some customers twice for the same order.",
    "The orchestra played Beethoven's fifth symphony to a full hall.",
    "Volcanic ash grounded hundreds of flights across northern Europe for almost a week.",
    "My grandmother still writes letters by hand and sends them with a stamp.",
    "The new phone has a larger battery, a better camera and a screen that is easier to read in sunlight.",
    "Thank you for your patience; your order will ship tomorrow.",
    "In the final minute of the match, the goalkeeper saved a penalty and the crowd went wild.",
    "Glaciers in the Alps have lost more than half of their volume since the middle of the nineteenth century.",
    "The teacher asked the students to summarise the article in their own words.",
    "Turn left at the bakery, walk past the church and the post office is on your right.",
    "The startup raised twelve million dollars to build software that helps hospitals schedule nurses.",
    "Wolves were reintroduced to the park in 1995, and the deer began to avoid the open valleys.",
    "Is it going to snow this weekend?",
    "The contract can be terminated by either party with thirty days' written notice, provided that all "
    "outstanding invoices have been paid.",
    "After the storm, volunteers cleared fallen trees from the roads and brought food to families without "
    "power.",
    "Coffee prices climbed after a drought damaged harvests in Brazil.",
    "The detective noticed that the clock on the mantelpiece had stopped at a quarter past nine.",
    "Children learn languages more easily when they hear them spoken at home.",
    "Update your password regularly and never share it with anyone.",
    "The bridge, which opened in 1932, carries about a hundred thousand vehicles every day and needs constant "
    "repair.",
    "He apologised for the mistake and offered to pay for the damage.",
    "Solar panels on the school roof now supply most of its electricity during the summer months.",
    "We walked along the beach at sunset and watched the fishing boats come in.",
    "The painting was sold at auction for a price far above the estimate, to a buyer who wished to remain "
    "anonymous.",
    "Antibiotics do not work against viruses such as the common cold or the flu.",
    "Let me know if you need anything else.",
    "The train was so crowded that we had to stand all the way to the coast, holding our bags above our heads.",
    "Scientists measured the distance to the galaxy using the light from a distant supernova.",
    "The company will close two factories and move production overseas next year.",
    "Honey never spoils if it is kept in a sealed jar.",
)

# Calibration text for int8 (export.optimize.smooth_activations): a separate set, so that the gate's
# figures on SENTENCES are measured on text the quantisation did not see.
CALIBRATION_SENTENCES: tuple[str, ...] = (
    "The bus to the airport leaves every twenty minutes from the main square.",
    "Add two cups of water and let the rice simmer until it is soft.",
    "Our quarterly report shows that sales in Asia grew faster than anywhere else.",
    "Why did the printer stop working again?",
    "The hikers reached the summit just before the fog rolled in over the ridge.",
    "Doctors recommend at least thirty minutes of moderate exercise on most days of the week.",
    "The software update fixes a crash that happened when users opened very large spreadsheets.",
    "Several streets in the old town will be closed on Sunday for the annual cycling race.",
    "She translated the novel from Portuguese, keeping the author's long and winding sentences.",
    "Bees visit thousands of flowers to make a single spoonful of honey.",
    "The judge postponed the trial after the defence asked for more time to review the evidence.",
    "Yes, I'll be there at seven.",
    "Heavy rain is expected along the coast tonight, with winds reaching eighty kilometres an hour in exposed "
    "places.",
    "The old lighthouse was turned into a small museum about the ships that sank nearby.",
    "Most of the students preferred the online course because they could study in the evening after work.",
    "Keep the receipt in case you need to return the jacket.",
    "The city council approved a plan to plant ten thousand trees over the next five years.",
    "Astronomers discovered a planet that orbits its star once every four days.",
    "He forgot his umbrella on the train and walked home in the rain.",
    "The price of the tickets includes a guided tour of the castle and lunch in the garden.",
    "Engineers tested the new battery in freezing temperatures to see how quickly it lost its charge.",
    "I'm sorry, but the manager is not available right now.",
    "The farmers' market sells fresh bread, cheese, apples and flowers every Saturday morning.",
    "A power cut in the data centre took the website offline for nearly an hour.",
)
